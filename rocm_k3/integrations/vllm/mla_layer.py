"""MLA under vLLM, the two paths :func:`~.arch.choose_mla_path` picks between (and :func:`describe_mla_path` logs).

:class:`LatentMLA`: vLLM's own MLA layer (``MLAAttention``) caches the normalised latent and the rope key (one
``kv_lora_rank + rope`` wide KV head) and runs the absorbed decode and the expanded prefill of its MLA backends;
rocm-k3's layer keeps its projections, its ``kv_b`` weight (handed to vLLM as an unquantised linear) and its output
gate. K3's MLA is NoPE: nothing is rotated.

:class:`ExpandedMLA`: expanded-head attention through vLLM's standard ``Attention`` layer, for where vLLM's MLA
backends cannot take the model (the CPU with a hybrid KDA page, whose block size is far above the 16 tokens the CPU
MLA backend takes). The expanded form is exact: per head the key is
``k_nope | k_pe`` (the shared rope part broadcast to every head) and the value ``v`` (from ``kv_b`` of the
normalised latent), zero-padded to the same width; queries keep ``q_nope | q_pe`` (NoPE: never rotated).
Zero-padding the value adds zero output columns, which are dropped; padding q and k (when the head size is
rounded up to a size every backend takes) adds zero to every dot product. The scale stays ``q_head_dim ** -0.5``.
The cost: ``Hl * 2 * head_size`` cached values per token instead of 576.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.mla_attention import MLAAttention

from rocm_k3.integrations.vllm.arch import MLAPath, expanded_head_size
from rocm_k3.model.mla import MLALayer


def describe_mla_path(path: MLAPath, layer: "LatentMLA | ExpandedMLA | None") -> str:
    """The MLA path of a built model and why (logged once per model)."""
    if layer is None:
        return "no MLA layers"
    if isinstance(layer, LatentMLA):
        return (f"MLA through vLLM's latent MLA layer ({layer.attn.attn_backend.get_name()} backend, "
                f"{layer.mla.heads} heads over one {layer.attn.head_size}-wide latent KV head): {path.reason}")
    return (f"MLA as expanded-head attention through vLLM's standard Attention ({layer.mla.heads} heads of "
            f"{layer.head_size} values, values zero-padded): {path.reason}")


class _KvBAsVllmLinear(nn.Module):
    """rocm-k3's ``kv_b`` projection as vLLM's MLA layer reads a linear: ``weight`` [H (Dn + Dv), R], no quant
    method, called as ``(out, bias)``. It owns no parameter: the weight stays rocm-k3's (loaded and named there)."""

    quant_method = None

    def __init__(self, kv_b: nn.Module) -> None:
        super().__init__()
        self._kv_b = (kv_b,)  # a tuple, so nn.Module does not register it a second time

    @property
    def weight(self) -> torch.Tensor:
        return self._kv_b[0].weight

    def forward(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self._kv_b[0](c_kv), None  # [T, H (Dn + Dv)]


class LatentMLA(nn.Module):
    """``forward(x [T, hidden], *_) -> [T, hidden]``: rocm-k3's MLA sublayer with the attention in vLLM's latent
    ``MLAAttention`` (registered as ``prefix + ".attn"``)."""

    def __init__(self, mla: MLALayer, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        cfg = mla.cfg
        self.mla, self.cfg = mla, cfg
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if vllm_config.model_config.get_head_size() != width:
            raise ValueError(f"vLLM sizes the MLA latent as {vllm_config.model_config.get_head_size()}, this model's "
                             f"is {width}: the rocm-k3 config view is not registered (is the vLLM plugin loaded?)")
        self.attn = MLAAttention(num_heads=mla.heads, scale=mla.scale, qk_nope_head_dim=cfg.qk_nope_head_dim,
                                 qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                                 q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                                 kv_b_proj=_KvBAsVllmLinear(mla.kv_b), cache_config=vllm_config.cache_config,
                                 prefix=prefix + ".attn")

    def forward(self, x: torch.Tensor, *_unused) -> torch.Tensor:
        cfg, mla = self.cfg, self.mla
        t, h = x.shape[0], mla.heads
        q, c_kv, k_pe, gate = mla.project(x)  # [T, Hl, Dn + P], [T, R] (normed), [T, P], [T, Hl Dv]
        out = self.attn(q, c_kv, k_pe.unsqueeze(1), output_shape=torch.Size((t, h * cfg.v_head_dim)))  # [T, Hl Dv]
        return mla.output(out.view(t, h, cfg.v_head_dim), gate)


class ExpandedMLA(nn.Module):
    """``forward(x [T, hidden], *_) -> [T, hidden]``: rocm-k3's MLA sublayer (its projections and output gate)
    with the attention itself in vLLM's paged ``Attention`` (registered as ``prefix + ".attn"``)."""

    def __init__(self, mla: MLALayer, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        cfg = mla.cfg
        self.mla, self.cfg = mla, cfg
        self.head_size = expanded_head_size(cfg.q_head_dim, cfg.v_head_dim)
        if vllm_config.model_config.get_head_size() != self.head_size:
            raise ValueError(f"vLLM sizes attention heads as {vllm_config.model_config.get_head_size()}, the "
                             f"plugin's expanded MLA needs {self.head_size}: the rocm-k3 config view is not "
                             f"registered for this model (is the rocm_k3 vLLM plugin loaded?)")
        self.attn = Attention(num_heads=mla.heads, head_size=self.head_size, scale=mla.scale,
                              num_kv_heads=mla.heads, cache_config=vllm_config.cache_config, prefix=prefix + ".attn")

    def forward(self, x: torch.Tensor, *_unused) -> torch.Tensor:
        cfg, mla, hs = self.cfg, self.mla, self.head_size
        t, h = x.shape[0], mla.heads
        q, c_kv, k_pe, gate = mla.project(x)  # [T, Hl, Dn + P], [T, R], [T, P], [T, Hl Dv]
        kv = mla.kv_b(c_kv).view(t, h, cfg.qk_nope_head_dim + cfg.v_head_dim)  # [T, Hl, Dn + Dv]
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(t, h, cfg.qk_rope_head_dim)], dim=-1)  # [T, Hl, Dn + P]
        q, k = (F.pad(a, (0, hs - cfg.q_head_dim)) for a in (q, k))  # [T, Hl, hs]
        v = F.pad(v, (0, hs - cfg.v_head_dim))  # [T, Hl, hs]
        out = self.attn(q.reshape(t, h * hs), k.reshape(t, h * hs), v.reshape(t, h * hs))  # [T, Hl hs]
        return mla.output(out.view(t, h, hs)[..., : cfg.v_head_dim], gate)


