"""Types of the ``moe`` op family: the activation config, the router result and the routed-expert weights.

Re-exported by :mod:`rocm_k3.ops.moe`; kept apart so the references and kernel backends can import them
without importing the public op module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from rocm_k3.quant.blocks import BLOCK_SIZE

__all__ = [
    "ACTIVATION_KINDS",
    "ACT_QUANT_CHOICES",
    "DEFAULT_ACTIVATION",
    "EXPERT_FORMATS",
    "ExpertWeights",
    "MoEActivation",
    "RouteResult",
]

ACTIVATION_KINDS = ("situ", "silu")
ACT_QUANT_CHOICES = ("bf16", "mxfp8")
EXPERT_FORMATS = ("mxfp4", "bf16")
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def positive_or_none(value: object, name: str, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number{' or None' if allow_none else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MoEActivation:
    """Expert activation: ``kind`` "situ" (K3; uses beta and linear_beta) or "silu" (Kimi Linear; ignores them)."""

    kind: str = "situ"
    beta: float = 4.0
    linear_beta: float | None = 25.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"MoEActivation.kind must be one of {ACTIVATION_KINDS}, got {self.kind!r}")
        positive_or_none(self.beta, "MoEActivation.beta", allow_none=False)
        positive_or_none(self.linear_beta, "MoEActivation.linear_beta", allow_none=True)


DEFAULT_ACTIVATION = MoEActivation()  # K3's SiTU (beta 4, linear_beta 25); frozen, safe as a shared default


class RouteResult(NamedTuple):
    """Router output: ``weights`` fp32 [T, k], ``ids`` int32 [T, k] (ordered by descending score)."""

    weights: torch.Tensor
    ids: torch.Tensor


def check_tensor(t: object, name: str, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    return t


def check_shape(t: torch.Tensor, name: str, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {meaning} = {expected}, got {tuple(t.shape)}")


@dataclasses.dataclass
class ExpertWeights:
    """Routed-expert weights of one MoE layer, always held in checkpoint layout.

    fmt "mxfp4": ``w13`` uint8 [E, 2N, K/2], ``w13_scale`` uint8 [E, 2N, K/32], ``w2`` uint8 [E, Kout, N/2],
    ``w2_scale`` uint8 [E, Kout, N/32] (compressed-tensors packing, K and N multiples of 32).
    fmt "bf16": ``w13`` [E, 2N, K] and ``w2`` [E, Kout, N] (bf16; fp16/fp32 accepted), scales None.
    Rows of w13: the first N are the gate (w1), the next N the up projection (w3).
    ``layout`` names the backend whose ``prepare_weights`` filled ``extras`` with its re-laid private tensors;
    the checkpoint-layout tensors stay valid so any backend (and the reference) can still run the layer.
    """

    fmt: str
    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    layout: str = "checkpoint"
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fmt not in EXPERT_FORMATS:
            raise ValueError(f"ExpertWeights.fmt must be one of {EXPERT_FORMATS}, got {self.fmt!r}")
        if not isinstance(self.layout, str) or not self.layout:
            raise ValueError(f"ExpertWeights.layout must be a non-empty str, got {self.layout!r}")
        if not isinstance(self.extras, dict):
            raise TypeError(f"ExpertWeights.extras must be a dict, got {type(self.extras).__name__}")
        if self.fmt == "mxfp4":
            self._check_mxfp4()
        else:
            self._check_dense()
        for name in ("w2", "w13_scale", "w2_scale"):
            t = getattr(self, name)
            if t is not None and t.device != self.w13.device:
                raise ValueError(
                    f"ExpertWeights.{name} must be on the device of w13 ({self.w13.device}), got {t.device}"
                )

    def _check_mxfp4(self) -> None:
        u8 = (torch.uint8,)
        w13 = check_tensor(self.w13, "ExpertWeights.w13", 3, u8)
        w2 = check_tensor(self.w2, "ExpertWeights.w2", 3, u8)
        num_experts, two_n, half_k = w13.shape
        if two_n == 0 or two_n % (2 * BLOCK_SIZE) or half_k == 0 or (2 * half_k) % BLOCK_SIZE:
            raise ValueError(
                "ExpertWeights.w13 must have shape [E, 2N, K/2] with N and K positive multiples of 32, "
                f"got {tuple(w13.shape)}"
            )
        n, k = two_n // 2, 2 * half_k
        if w2.shape[0] != num_experts or w2.shape[1] == 0 or w2.shape[2] != n // 2:
            raise ValueError(
                f"ExpertWeights.w2 must have shape [E, Kout, N/2] = [{num_experts}, Kout, {n // 2}], "
                f"got {tuple(w2.shape)}"
            )
        w13s = check_tensor(self.w13_scale, "ExpertWeights.w13_scale", 3, u8)
        w2s = check_tensor(self.w2_scale, "ExpertWeights.w2_scale", 3, u8)
        check_shape(w13s, "ExpertWeights.w13_scale", (num_experts, two_n, k // BLOCK_SIZE), "[E, 2N, K/32]")
        check_shape(w2s, "ExpertWeights.w2_scale", (num_experts, w2.shape[1], n // BLOCK_SIZE), "[E, Kout, N/32]")

    def _check_dense(self) -> None:
        w13 = check_tensor(self.w13, "ExpertWeights.w13", 3, ACT_DTYPES)
        w2 = check_tensor(self.w2, "ExpertWeights.w2", 3, ACT_DTYPES)
        if w2.dtype != w13.dtype:
            raise TypeError(f"ExpertWeights.w2 must have the dtype of w13 ({w13.dtype}), got {w2.dtype}")
        if self.w13_scale is not None or self.w2_scale is not None:
            raise ValueError("ExpertWeights with fmt 'bf16' take no scales (w13_scale and w2_scale must be None)")
        num_experts, two_n, k = w13.shape
        if two_n == 0 or two_n % 2 or k == 0:
            raise ValueError(f"ExpertWeights.w13 must have shape [E, 2N, K] with N, K > 0, got {tuple(w13.shape)}")
        if w2.shape[0] != num_experts or w2.shape[1] == 0 or w2.shape[2] != two_n // 2:
            raise ValueError(
                f"ExpertWeights.w2 must have shape [E, Kout, N] = [{num_experts}, Kout, {two_n // 2}], "
                f"got {tuple(w2.shape)}"
            )

    @property
    def num_experts(self) -> int:
        """E."""
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        """K: the input features of w13."""
        return self.w13.shape[2] * (2 if self.fmt == "mxfp4" else 1)

    @property
    def intermediate(self) -> int:
        """N: the activation width (w13 has 2N output rows)."""
        return self.w13.shape[1] // 2

    @property
    def out_features(self) -> int:
        """Kout: the output features of w2."""
        return self.w2.shape[1]
