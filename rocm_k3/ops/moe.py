"""The ``moe`` op family: router, activation-and-multiply and the fused routed-expert MoE.

- ``situ_and_mul(x [..., 2N], beta=4.0, linear_beta=25.0) -> [..., N]``: gate = x[..., :N], up = x[..., N:],
  ``beta*tanh(g/beta)*sigmoid(g) * (linear_beta*tanh(u/linear_beta) if linear_beta is not None else u)`` (fp32 math).
- ``silu_and_mul(x [..., 2N]) -> [..., N]``: ``silu(g) * u``.
- ``route(router_logits fp32 [T, E], top_k, *, correction_bias fp32 [E] | None, renormalize, scaling_factor)``:
  noaux_tc with one group: ``s = sigmoid(logits)``, choose the top-k of ``s + bias`` (the bias only selects; ties
  go to the lower expert index), ``w = s[chosen]``, renormalised to sum 1 if asked, times ``scaling_factor``.
- ``fused_moe(x [T, K], weights: ExpertWeights, topk_weights fp32 [T, k], topk_ids int32 [T, k], *, activation,
  act_quant, fp8_dtype) -> [T, Kout]`` (x dtype): ``out[t] = sum_j w[t,j] * W2_e act(W13_e x_t)``, ``e = ids[t,j]``.
  act_quant "bf16" is A16W4 (x as is); "mxfp8" is A8W4: x and the activation output are quantised to MXFP8
  (``fp8_dtype``, ct rule) before their GEMMs.
"""

from __future__ import annotations

import torch

from rocm_k3.ops import registry
from rocm_k3.ops.moe_reference import (
    fused_moe_reference,
    route_reference,
    silu_and_mul_reference,
    situ_and_mul_reference,
)
from rocm_k3.ops.moe_types import (
    ACT_DTYPES,
    ACT_QUANT_CHOICES,
    DEFAULT_ACTIVATION,
    EXPERT_FORMATS,
    ExpertDims,
    ExpertWeights,
    MoEActivation,
    RouteResult,
    check_shape,
    check_tensor,
    positive_or_none,
)
from rocm_k3.quant.blocks import BLOCK_SIZE
from rocm_k3.quant.mxfp8 import fp8_format

__all__ = [
    "ACT_QUANT_CHOICES",
    "EXPERT_FORMATS",
    "ExpertDims",
    "ExpertWeights",
    "MoEActivation",
    "REFERENCE_IMPLS",
    "RouteResult",
    "fused_moe",
    "prepare_expert_weights",
    "route",
    "silu_and_mul",
    "situ_and_mul",
]


def _check_gated_input(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape [..., 2N] with N > 0 (gate | up halves), got {tuple(x.shape)}")
    return x


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0, *,
                 backend: str | None = None) -> torch.Tensor:
    """SiTU-and-mul: ``x [..., 2N]`` (bf16/fp16/fp32) -> ``[..., N]`` in x dtype.

    ``beta*tanh(g/beta)*sigmoid(g) * (linear_beta*tanh(u/linear_beta) if linear_beta is not None else u)`` with
    ``g = x[..., :N]``, ``u = x[..., N:]``, fp32 math.
    """
    _check_gated_input(x)
    positive_or_none(beta, "beta", allow_none=False)
    positive_or_none(linear_beta, "linear_beta", allow_none=True)
    return registry.dispatch("situ_and_mul", backend, x, beta, linear_beta)


def silu_and_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """SiLU-and-mul: ``x [..., 2N]`` -> ``silu(x[..., :N]) * x[..., N:]`` ``[..., N]`` in x dtype (fp32 math)."""
    _check_gated_input(x)
    return registry.dispatch("silu_and_mul", backend, x)


def route(router_logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor | None = None,
          renormalize: bool = True, scaling_factor: float = 1.0, backend: str | None = None) -> RouteResult:
    """noaux_tc sigmoid router (one group): ``router_logits fp32 [T, E]`` -> ``RouteResult``.

    ``RouteResult.weights`` fp32 [T, k], ``RouteResult.ids`` int32 [T, k].

    Chooses the top-k experts of ``sigmoid(logits) + correction_bias`` (ties: lower index first; ids ordered by
    descending score); weights are ``sigmoid(logits)`` at the chosen ids, renormalised to sum 1 when
    ``renormalize``, times ``scaling_factor``.
    """
    check_tensor(router_logits, "router_logits", 2, (torch.float32,))
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
    if correction_bias is not None:
        check_tensor(correction_bias, "correction_bias", 1, (torch.float32,))
        check_shape(correction_bias, "correction_bias", (num_experts,), "[E]")
        if correction_bias.device != router_logits.device:
            raise ValueError(
                f"correction_bias must be on the device of router_logits ({router_logits.device}), "
                f"got {correction_bias.device}"
            )
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    positive_or_none(scaling_factor, "scaling_factor", allow_none=False)
    return registry.dispatch(
        "route",
        backend,
        router_logits,
        top_k,
        correction_bias=correction_bias,
        renormalize=renormalize,
        scaling_factor=scaling_factor,
    )


def _check_ids_in_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """ValueError if an expert id is outside [0, E). Skipped while a CUDA graph is being captured (no host sync)."""
    if topk_ids.numel() == 0:
        return
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"topk_ids must lie in [0, E={num_experts}), got values in [{low}, {high}]")


def fused_moe(x: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              activation: MoEActivation = DEFAULT_ACTIVATION, act_quant: str = "bf16",
              fp8_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Routed experts: ``x [T, K]`` (bf16/fp16/fp32) -> ``[T, Kout]`` in x dtype.

    ``out[t] = sum_j topk_weights[t, j] * W2_e act(W13_e x_t)`` with ``e = topk_ids[t, j]`` (int32 [T, k], in
    [0, E)), ``topk_weights`` fp32 [T, k], ``act`` the gate|up activation-and-multiply of ``activation``.
    ``act_quant``: "bf16" (A16W4: x used as is) or "mxfp8" (A8W4: x and act(...) are quantised to MXFP8 in
    ``fp8_dtype`` with the ct rule before their GEMMs; ``fp8_dtype`` is then required, see
    :func:`rocm_k3.quant.fp8_dtype_for_arch`). With "bf16" a given ``fp8_dtype`` is validated and ignored.
    """
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    check_tensor(x, "x", 2, ACT_DTYPES)
    if x.shape[1] != weights.hidden:
        raise ValueError(f"x must have shape [T, K] with K = weights.hidden = {weights.hidden}, got {tuple(x.shape)}")
    if x.device != weights.device:
        raise ValueError(f"x ({x.device}) and the expert weights ({weights.device}) must be on one device")
    check_tensor(topk_weights, "topk_weights", 2, (torch.float32,))
    check_tensor(topk_ids, "topk_ids", 2, (torch.int32,))
    if topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] == 0:
        raise ValueError(
            f"topk_ids must have shape [T, k] with T = {x.shape[0]} and k > 0, got {tuple(topk_ids.shape)}"
        )
    check_shape(topk_weights, "topk_weights", tuple(topk_ids.shape), "[T, k] (the shape of topk_ids)")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on the device of x ({x.device}), got {t.device}")
    if registry.checks_values(backend):
        _check_ids_in_range(topk_ids, weights.num_experts)
    if not isinstance(activation, MoEActivation):
        raise TypeError(f"activation must be a MoEActivation, got {type(activation).__name__}")
    if act_quant not in ACT_QUANT_CHOICES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_CHOICES}, got {act_quant!r}")
    if fp8_dtype is not None:
        fp8_format(fp8_dtype)
    if act_quant == "mxfp8":
        if fp8_dtype is None:
            raise ValueError("act_quant='mxfp8' needs fp8_dtype (torch.float8_e4m3fn or torch.float8_e4m3fnuz)")
        if weights.hidden % BLOCK_SIZE or weights.intermediate % BLOCK_SIZE:
            raise ValueError(
                f"act_quant='mxfp8' needs K and N multiples of {BLOCK_SIZE}, "
                f"got K={weights.hidden}, N={weights.intermediate}"
            )
    return registry.dispatch(
        "fused_moe",
        backend,
        x,
        weights,
        topk_weights,
        topk_ids,
        activation=activation,
        act_quant=act_quant,
        fp8_dtype=fp8_dtype,
    )


def prepare_expert_weights(weights: ExpertWeights, *, backend: str | None = None) -> ExpertWeights:
    """Re-lay routed experts once, at load time, for the backend that will run ``fused_moe`` on their device.

    The backend is the one named (argument or settings) or the first available in the device's priority order;
    its module's ``prepare_weights`` returns the weights in its own layout. A backend that re-lays MXFP4 experts
    keeps only the re-laid tensors (the experts then sit in memory once; drop your reference to ``weights``), and
    every other backend, the reference included, still runs the result through
    :meth:`ExpertWeights.checkpoint_expert`. Backends without a ``prepare_weights`` hook, and the reference,
    return ``weights`` as is.
    """
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"prepare_expert_weights: weights must be an ExpertWeights, got {type(weights).__name__}")
    return registry.prepare_weights(weights, backend, weights.device)


REFERENCE_IMPLS = {
    "situ_and_mul": situ_and_mul_reference,
    "silu_and_mul": silu_and_mul_reference,
    "route": route_reference,
    "fused_moe": fused_moe_reference,
}
