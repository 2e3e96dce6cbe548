"""Bidirectional attention over packed variable-length sequences (the vision tower's per-image attention).

- ``varlen_attention(q [T, H, D], k [T, H, D], v [T, H, D], cu_seqlens int32 [N + 1], *, scale=None,
  max_seqlen=None) -> [T, H, D]`` (q dtype).

N sequences are packed along T; sequence i owns rows ``cu_seqlens[i] : cu_seqlens[i + 1]`` and attends to its
own rows only, with no causal mask (NaViT packing: one sequence per image). Per head h and query row t of
sequence i (fp32 math)::

    s[t, u] = scale * q[t, h] . k[u, h]          for u in sequence i
    out[t, h] = softmax_u(s[t]) @ v[sequence i, h]

``scale`` defaults to D^-0.5. ``max_seqlen`` (the longest sequence) lets a kernel size its launch grid without
reading ``cu_seqlens`` back to the host; when None the kernel computes it (one device sync).

The public function checks shapes, dtypes and devices only (no device sync); the reference additionally checks
the values of ``cu_seqlens`` (starts at 0, ends at T, non-decreasing) and raises ValueError; kernels trust them.
"""

from __future__ import annotations

import math

import torch

from rocm_k3.ops import registry
from rocm_k3.ops.tensor_checks import check_like

__all__ = ["REFERENCE_IMPLS", "varlen_attention", "varlen_attention_reference"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_qkv(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {t.dtype}")
    if q.dim() != 3 or q.shape[1] == 0 or q.shape[2] == 0:
        raise ValueError(f"q must have shape [T, H, D] with H, D > 0, got {list(q.shape)}")
    check_like("q", q, {"k": k, "v": v})


def _check_cu_seqlens(cu_seqlens: object, q: torch.Tensor) -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1, got {list(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}; all must share a device")


def _check_scale_and_max(scale: object, max_seqlen: object) -> None:
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {scale}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be a non-negative int or None, got {max_seqlen!r}")


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None = None) -> list[int]:
    """``cu_seqlens`` as host ints after checking 0 = cu[0] <= cu[1] <= ... <= cu[N] = T (a device sync).

    With ``max_seqlen`` given, also checks that no sequence is longer (a kernel sizes its grid from it).
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {total}, got {cu}")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if max_seqlen is not None and lens and max(lens) > max_seqlen:
        raise ValueError(f"max_seqlen = {max_seqlen} but the longest sequence has {max(lens)} rows")
    return cu


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                               scale: float | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """Per-sequence softmax attention in fp32 (validates the cu_seqlens values); returns q's dtype."""
    cu = check_cu_seqlens_values(cu_seqlens, q.shape[0], max_seqlen)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out = torch.empty_like(q)  # [T, H, D]
    for start, end in zip(cu, cu[1:]):
        if start == end:
            continue
        qi, ki, vi = (x[start:end].float().transpose(0, 1) for x in (q, k, v))  # [H, L, D] each
        probs = torch.softmax((qi @ ki.transpose(1, 2)) * scale, dim=-1)  # [H, L, L]
        out[start:end] = (probs @ vi).transpose(0, 1).to(q.dtype)  # [L, H, D]
    return out


REFERENCE_IMPLS = {"varlen_attention": varlen_attention_reference}


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, max_seqlen: int | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """Bidirectional attention within each packed sequence (module docstring).

    Args:
        q, k, v: [T, H, D], one dtype (fp32/bf16/fp16) and device; N sequences packed along T.
        cu_seqlens: int32 [N + 1], ``cu_seqlens[0] = 0``, ``cu_seqlens[N] = T``, non-decreasing.
        scale: softmax scale, default D^-0.5.
        max_seqlen: the longest sequence (optional; lets a kernel avoid a device sync).

    Returns: [T, H, D] in q's dtype.
    """
    _check_qkv(q, k, v)
    _check_cu_seqlens(cu_seqlens, q)
    _check_scale_and_max(scale, max_seqlen)
    return registry.dispatch("varlen_attention", backend, q, k, v, cu_seqlens, scale=scale, max_seqlen=max_seqlen)
