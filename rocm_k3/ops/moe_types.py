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
    "ExpertDims",
    "LAYOUT_CODECS",
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


# Prepared layouts whose backend stores only its re-laid tensors: layout name -> module with
# ``checkpoint_expert(weights, e)`` and ``to_checkpoint(weights)`` (pure torch, imported on first use).
LAYOUT_CODECS = {
    "triton": "rocm_k3.triton_kernels.moe.layout",
    "flydsl": "rocm_k3.flydsl_kernels.weights",
}


@dataclasses.dataclass(frozen=True)
class ExpertDims:
    """Logical sizes of a routed-expert layer: E experts, w13 [2N, K] (gate | up), w2 [Kout, N], on ``device``."""

    num_experts: int
    hidden: int
    intermediate: int
    out_features: int
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden", "intermediate", "out_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ExpertDims.{name} must be a positive int, got {value!r}")
        if not isinstance(self.device, torch.device):
            raise TypeError(f"ExpertDims.device must be a torch.device, got {type(self.device).__name__}")


def _from_dims(name: str, doc: str) -> property:
    """A read-only attribute of :class:`ExpertWeights` that is the attribute ``name`` of its ``dims``."""
    return property(lambda self: getattr(self.dims, name), doc=doc)


@dataclasses.dataclass
class ExpertWeights:
    """Routed-expert weights of one MoE layer, in checkpoint layout or in one backend's prepared layout.

    Checkpoint layout (``layout="checkpoint"``, or a backend layout that reads the checkpoint tensors as they are):
    fmt "mxfp4": ``w13`` uint8 [E, 2N, K/2], ``w13_scale`` uint8 [E, 2N, K/32], ``w2`` uint8 [E, Kout, N/2],
    ``w2_scale`` uint8 [E, Kout, N/32] (compressed-tensors packing, K and N multiples of 32).
    fmt "bf16": ``w13`` [E, 2N, K] and ``w2`` [E, Kout, N] (bf16; fp16/fp32 accepted), scales None.
    Rows of w13: the first N are the gate (w1), the next N the up projection (w3).

    Prepared layout (``ExpertWeights.prepared``): the four checkpoint fields are None, ``dims`` gives the sizes
    and ``extras`` holds the backend's re-laid tensors only, so the experts sit in memory once. The reference
    (and any other backend) reads such weights expert by expert through :meth:`checkpoint_expert`, which asks the
    layout's codec (``LAYOUT_CODECS``) to undo the re-layout; :meth:`to_checkpoint` rebuilds all of it.
    """

    fmt: str
    w13: torch.Tensor | None
    w13_scale: torch.Tensor | None
    w2: torch.Tensor | None
    w2_scale: torch.Tensor | None
    layout: str = "checkpoint"
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    dims: ExpertDims | None = None

    def __post_init__(self) -> None:
        if self.fmt not in EXPERT_FORMATS:
            raise ValueError(f"ExpertWeights.fmt must be one of {EXPERT_FORMATS}, got {self.fmt!r}")
        if not isinstance(self.layout, str) or not self.layout:
            raise ValueError(f"ExpertWeights.layout must be a non-empty str, got {self.layout!r}")
        if not isinstance(self.extras, dict):
            raise TypeError(f"ExpertWeights.extras must be a dict, got {type(self.extras).__name__}")
        if self.w13 is None:
            self._check_prepared()
            return
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
        dims = ExpertDims(self.w13.shape[0], self.w13.shape[2] * (2 if self.fmt == "mxfp4" else 1),
                          self.w13.shape[1] // 2, self.w2.shape[1], self.w13.device)
        if self.dims is not None and self.dims != dims:
            raise ValueError(f"ExpertWeights.dims {self.dims} disagree with the tensors' shapes {dims}")
        self.dims = dims

    @classmethod
    def prepared(cls, fmt: str, layout: str, dims: ExpertDims, extras: dict[str, Any]) -> ExpertWeights:
        """Weights held only in ``layout``'s re-laid tensors (``extras``); see the class docstring."""
        return cls(fmt, None, None, None, None, layout=layout, extras=extras, dims=dims)

    def _check_prepared(self) -> None:
        if any(t is not None for t in (self.w13_scale, self.w2, self.w2_scale)):
            raise ValueError("ExpertWeights without w13 (a prepared layout) must have no checkpoint tensors at all")
        if not isinstance(self.dims, ExpertDims):
            raise TypeError("ExpertWeights in a prepared layout (no checkpoint tensors) need dims: ExpertDims")
        if self.layout not in LAYOUT_CODECS:
            raise ValueError(
                f"ExpertWeights without checkpoint tensors must be in a layout with a codec {sorted(LAYOUT_CODECS)}, "
                f"got {self.layout!r}"
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
    def has_checkpoint_tensors(self) -> bool:
        """Whether ``w13`` / ``w2`` (and scales) hold the checkpoint layout (False: only ``extras`` has them)."""
        return self.w13 is not None

    def _codec(self) -> Any:
        import importlib

        return importlib.import_module(LAYOUT_CODECS[self.layout])

    def checkpoint_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Checkpoint-layout tensors of expert ``e``: (w13 [2N, K/2 or K], w13_scale, w2 [Kout, N/2 or N], w2_scale)."""
        if self.w13 is not None:
            s13 = None if self.w13_scale is None else self.w13_scale[e]
            s2 = None if self.w2_scale is None else self.w2_scale[e]
            return self.w13[e], s13, self.w2[e], s2
        return self._codec().checkpoint_expert(self, e)

    def to_checkpoint(self) -> ExpertWeights:
        """These weights in checkpoint layout (``self`` when they already are; a rebuilt copy otherwise)."""
        if self.w13 is not None:
            return self if self.layout == "checkpoint" else ExpertWeights(
                self.fmt, self.w13, self.w13_scale, self.w2, self.w2_scale)
        return self._codec().to_checkpoint(self)

    # sizes and device, read from ``dims`` (set for both layouts)
    device = _from_dims("device", "The device every tensor of these weights lives on.")
    num_experts = _from_dims("num_experts", "E.")
    hidden = _from_dims("hidden", "K: the input features of w13.")
    intermediate = _from_dims("intermediate", "N: the activation width (w13 has 2N output rows).")
    out_features = _from_dims("out_features", "Kout: the output features of w2.")
