"""The ``norm`` op family: RMSNorm and the fused residual add + RMSNorm.

- ``rms_norm(x [..., D], weight [D], eps=1e-5) -> [..., D]`` (x dtype):
  ``y = x * rsqrt(mean(x^2, -1) + eps) * weight``, computed in fp32.
- ``add_rms_norm(x [..., D], residual [..., D], weight [D], eps=1e-5) -> (normed, new_residual)``:
  ``new_residual = x + residual`` (summed in fp32, cast to x dtype), ``normed = rms_norm(new_residual)`` (the
  rounded new_residual is what gets normalised, so a fused kernel and the two-step path agree).
"""

from __future__ import annotations

import math

import torch

from rocm_k3.ops import registry
from rocm_k3.ops.tensor_checks import check_like

__all__ = ["REFERENCE_IMPLS", "add_rms_norm", "rms_norm"]

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_activation(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _ACT_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")
    if t.dim() == 0 or t.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., D] with D > 0, got {tuple(t.shape)}")
    return t


def _check_weight_eps(x: torch.Tensor, weight: object, eps: object) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"weight must be a floating tensor, got {weight.dtype}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape [D] = ({x.shape[-1]},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on the device of x ({x.device}), got {weight.device}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive float, got {eps!r}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Unvalidated RMSNorm over the last dim in fp32; returns x dtype."""
    xf = x.to(torch.float32)
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)  # [..., 1]
    return (xf * inv_rms * weight.to(torch.float32)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unvalidated fused add + RMSNorm: returns (rms_norm(x + residual), x + residual), both x dtype."""
    new_residual = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: str | None = None) -> torch.Tensor:
    """RMSNorm: ``x [..., D]`` (bf16/fp16/fp32), ``weight [D]`` (any float) -> ``[..., D]`` in x dtype.

    ``y = x * rsqrt(mean(x^2) + eps) * weight`` with fp32 math.
    """
    _check_activation(x, "x")
    _check_weight_eps(x, weight, eps)
    return registry.dispatch("rms_norm", backend, x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``x, residual [..., D]`` (same shape and dtype), ``weight [D]``.

    Returns ``(normed, new_residual)`` with ``new_residual = x + residual`` (fp32 sum cast to x dtype) and
    ``normed = rms_norm(new_residual, weight, eps)``; neither input is modified.
    """
    _check_activation(x, "x")
    _check_activation(residual, "residual")
    check_like("x", x, {"residual": residual})
    _check_weight_eps(x, weight, eps)
    return registry.dispatch("add_rms_norm", backend, x, residual, weight, eps)


REFERENCE_IMPLS = {
    "rms_norm": rms_norm_reference,
    "add_rms_norm": add_rms_norm_reference,
}
