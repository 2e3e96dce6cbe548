"""Feed-forward blocks (K3_SPEC section 4): the dense MLP of the first layers and the MoE block.

MoE: ``s = sigmoid(x W_gate^T)`` (fp32), top-k of ``s + bias`` (noaux_tc), weights renormalised and scaled;
routed experts run on ``x`` or, with LatentMoE, on ``z = down_proj(x)`` whose result is RMS-normalised and
``up_proj``-ed back to the hidden size; shared experts (one MLP of width ``moe_intermediate * n_shared``) run on
``x`` and are added. Activation everywhere: SiTU-and-mul (K3) or SiLU-and-mul (Kimi Linear).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.model.config import ModelConfig
from rocm_k3.ops.devices import device_info
from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.quant import fp8_dtype_for_arch

ACT_QUANT_MODES = ("bf16", "mxfp8")


@dataclasses.dataclass(frozen=True)
class ActQuant:
    """Activation format of the routed-expert GEMMs: "bf16" (A16W4, activations as they are) or "mxfp8" (A8W4:
    activations quantised to MXFP8 in ``fp8_dtype``, the format K3's experts were trained for)."""

    mode: str = "bf16"
    fp8_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.mode not in ACT_QUANT_MODES:
            raise ValueError(f"moe_act_quant: expected one of {ACT_QUANT_MODES}, got {self.mode!r}")
        if self.mode == "mxfp8" and self.fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise ValueError(f"fp8_dtype: A8W4 needs torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {self.fp8_dtype}")

    @classmethod
    def for_device(cls, mode: str, device: torch.device) -> ActQuant:
        """``mode`` with the FP8 variant of ``device``'s arch (gfx942: e4m3fnuz; gfx950, NVIDIA, CPU: e4m3fn)."""
        if mode != "mxfp8":
            return cls(mode)
        arch = device_info(device).arch
        return cls(mode, fp8_dtype_for_arch(arch) if arch is not None else torch.float8_e4m3fn)


def activation_for(cfg: ModelConfig) -> MoEActivation:
    if cfg.hidden_act == "situ":
        return MoEActivation("situ", cfg.situ_beta, cfg.situ_linear_beta)
    return MoEActivation("silu")


class DenseMLP:
    """``down(act(gate(x)) * up(x))`` with gate|up fused: ``gate_up [2I, hidden]``, ``down [hidden, I]``."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, activation: MoEActivation,
                 backend: str | None) -> None:
        self.gate_up = gate_up
        self.down = down
        self.activation = activation
        self.backend = backend

    @classmethod
    def from_checkpoint(cls, t: Mapping[str, torch.Tensor], activation: MoEActivation,
                        backend: str | None) -> DenseMLP:
        """``t`` maps ``gate_proj.weight`` / ``up_proj.weight`` / ``down_proj.weight`` to tensors."""
        gate_up = torch.cat([t["gate_proj.weight"], t["up_proj.weight"]], dim=0).contiguous()
        return cls(gate_up, t["down_proj.weight"], activation, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("mlp"):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.gate_up)  # [T, 2I]
        if self.activation.kind == "situ":
            a = ops.situ_and_mul(h, self.activation.beta, self.activation.linear_beta, backend=self.backend)
        else:
            a = ops.silu_and_mul(h, backend=self.backend)
        return F.linear(a, self.down)  # [T, hidden]


class MoEBlock:
    """Router + routed experts (optionally LatentMoE) + shared experts; ``forward(x [T, hidden]) -> [T, hidden]``.

    router fp32 [E, hidden]; bias fp32 [E]; experts: ExpertWeights over the expert width (latent or hidden);
    latent_down [latent, hidden], latent_up [hidden, latent], latent_norm [latent] or None.
    """

    def __init__(self, cfg: ModelConfig, router: torch.Tensor, bias: torch.Tensor, experts: ExpertWeights,
                 shared: DenseMLP | None, latent_down: torch.Tensor | None, latent_up: torch.Tensor | None,
                 latent_norm: torch.Tensor | None, backend: str | None, act_quant: ActQuant = ActQuant()) -> None:
        self.cfg = cfg
        self.router = router
        self.bias = bias
        self.experts = experts
        self.shared = shared
        self.latent_down = latent_down
        self.latent_up = latent_up
        self.latent_norm = latent_norm
        self.activation = activation_for(cfg)
        self.backend = backend
        self.act_quant = act_quant

    @classmethod
    def from_checkpoint(cls, cfg: ModelConfig, t: Mapping[str, torch.Tensor], backend: str | None,
                        act_quant: ActQuant = ActQuant()) -> MoEBlock:
        """``t`` maps names inside ``block_sparse_moe.`` to tensors; per-expert tensors are stacked here."""
        e = cfg.num_experts
        if cfg.expert_format == "mxfp4":
            def stack(w: str, kind: str) -> torch.Tensor:
                return torch.stack([t[f"experts.{i}.{w}.{kind}"] for i in range(e)])  # [E, out, in/2 or in/32]

            experts = ExpertWeights(
                fmt="mxfp4",
                w13=torch.cat([stack("w1", "weight_packed"), stack("w3", "weight_packed")], dim=1),  # [E, 2N, K/2]
                w13_scale=torch.cat([stack("w1", "weight_scale"), stack("w3", "weight_scale")], dim=1),
                w2=stack("w2", "weight_packed"),  # [E, Kout, N/2]
                w2_scale=stack("w2", "weight_scale"),
            )
        else:
            def stack_dense(w: str) -> torch.Tensor:
                return torch.stack([t[f"experts.{i}.{w}.weight"] for i in range(e)])  # [E, out, in]

            experts = ExpertWeights(
                fmt="bf16", w13=torch.cat([stack_dense("w1"), stack_dense("w3")], dim=1),  # [E, 2N, K]
                w13_scale=None, w2=stack_dense("w2"), w2_scale=None,
            )
        experts = ops.prepare_expert_weights(experts, backend=backend)  # backend layout, once at load
        shared = None
        if cfg.num_shared_experts:
            shared = DenseMLP.from_checkpoint(
                {k[len("shared_experts."):]: v for k, v in t.items() if k.startswith("shared_experts.")},
                activation_for(cfg), backend,
            )
        latent = cfg.routed_expert_hidden_size is not None
        return cls(
            cfg, t["gate.weight"].float(), t["gate.e_score_correction_bias"].float(), experts, shared,
            t["routed_expert_down_proj.weight"] if latent else None,
            t["routed_expert_up_proj.weight"] if latent else None,
            t["routed_expert_norm.weight"] if latent and cfg.latent_moe_use_norm else None,
            backend, act_quant,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("moe"):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        logits = F.linear(x.float(), self.router)  # fp32 [T, E]
        routed = ops.route(logits, cfg.num_experts_per_token, correction_bias=self.bias,
                           renormalize=cfg.moe_renormalize, scaling_factor=cfg.routed_scaling_factor,
                           backend=self.backend)
        z = x if self.latent_down is None else F.linear(x, self.latent_down)  # [T, expert width]
        r = ops.fused_moe(z, self.experts, routed.weights, routed.ids, activation=self.activation,
                          act_quant=self.act_quant.mode, fp8_dtype=self.act_quant.fp8_dtype,
                          backend=self.backend)  # [T, expert width]
        if self.latent_up is not None:
            if self.latent_norm is not None:
                r = ops.rms_norm(r, self.latent_norm, cfg.rms_norm_eps, backend=self.backend)
            r = F.linear(r, self.latent_up)  # [T, hidden]
        if self.shared is not None:
            r = r + self.shared.forward(x)
        return r
