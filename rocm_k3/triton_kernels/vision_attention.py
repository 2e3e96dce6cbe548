"""Bidirectional varlen attention on Triton (the op of :mod:`rocm_k3.ops.vision_attention`).

One program per (block of BLOCK_M query rows of one sequence, sequence, head) walks that sequence's keys in
blocks of BLOCK_N with an online softmax in the log2 domain (``s * scale * log2(e)``, ``exp2``), fp32
accumulators, and writes ``acc / l``. No mask other than the sequence bounds: every row of a sequence sees all
of its keys. The grid is ``(cdiv(max_seqlen, BLOCK_M), N, H)``; programs past their sequence's end exit. The
head dim is padded to a power of two >= 16 (K2.5's 72 -> 128) with masked loads.

``supports`` declines head dims over 256 (the q/k/v/acc tiles would not fit in registers), inputs whose last dim
is not contiguous, more than 65535 sequences or heads (grid limits), and tensors off the GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rocm_k3.triton_kernels.runtime import interpreted

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
_MAX_GRID = 65535
_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale_log2,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                             D: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 < length:
        rows = m0 + tl.arange(0, BLOCK_M)  # [BM] row index within the sequence
        rmask = rows < length
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        t = (start + rows).to(tl.int64)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)  # [BM, BD]
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong
            q = q.to(tl.float32)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(0, length, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)  # [BN] key index within the sequence
            cmask = cols < length
            u = (start + cols).to(tl.int64)
            kv_mask = cmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + u[:, None] * stride_kt + h * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + u[:, None] * stride_vt + h * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BM, BN], log2 domain
            s = tl.where(cmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds >= 1 key of the sequence
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m = m_new
        o = acc / l_sum[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


def _tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a head dim: 64 x 64 up to 128, 64 x 32 with 8 warps above."""
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 8)


def varlen_attention_with(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                          scale: float | None = None, max_seqlen: int | None = None,
                          block_m: int | None = None, block_n: int | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel with explicit tiles (powers of two >= 16) and an optional output buffer (tests poison it)."""
    tokens, heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if tokens == 0:
        return out
    bm, bn, warps = _tiles(head_dim)
    bm, bn = block_m or bm, block_n or bn
    for name, value in (("block_m", bm), ("block_n", bn)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # one device sync
    if max_seqlen == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else float(scale)
    n = cu_seqlens.shape[0] - 1
    grid = (triton.cdiv(max_seqlen, bm), n, heads)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        D=head_dim, DOT_F32=interpreted(_varlen_attention_kernel), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=warps, num_stages=2,
    )
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """``q, k, v [T, H, D]`` packed per ``cu_seqlens`` -> ``[T, H, D]`` (the op's contract)."""
    return varlen_attention_with(q, k, v, cu_seqlens, scale=scale, max_seqlen=max_seqlen)


def varlen_attention_supports(q, k, v, cu_seqlens, *, scale=None, max_seqlen=None) -> tuple[bool, str]:
    if q.device.type != "cuda":
        return False, f"the Triton kernel runs on a GPU, q is on {q.device}"
    if q.dtype not in _FLOAT_DTYPES:
        return False, f"q must be bf16/fp16/fp32, got {q.dtype}"
    if q.shape[-1] > MAX_HEAD_DIM:
        return False, f"head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not handled"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            return False, f"{name} must have a contiguous last dim"
    if cu_seqlens.shape[0] - 1 > _MAX_GRID or q.shape[1] > _MAX_GRID:
        return False, f"more than {_MAX_GRID} sequences or heads (grid limit)"
    if not cu_seqlens.is_contiguous():
        return False, "cu_seqlens must be contiguous"
    return True, "supported"


KERNELS = {"varlen_attention": (varlen_attention, varlen_attention_supports)}
