"""MLA prefill over the EXPANDED heads on Triton: flash attention for long prompts (K3_SPEC §3, NoPE + gate).

The absorbed kernel (:mod:`rocm_k3.triton_kernels.mla_prefill`) attends in the 512-d latent space: 2 (R + P + R) =
2176 FLOPs per (query, key, head) and 16-row query tiles. Over the expanded heads a pair costs 2 (Dn + P + Dv) =
640 FLOPs, at the price of expanding every context key once per call: ``[k_nope | v] = c_kv @ kv_b^T``, 2 R H
(Dn + Dv) FLOPs per key. For a chunk of n queries the expansion is paid back from n ~ 100 on the H200 (the
absorbed kernel's 16-row tiles also run its MMAs far below peak); the measured crossover sets
:data:`EXPANDED_MIN_QUERIES` (``benchmarks/bench_mla_prefill.py``), and ``mla_prefill`` sends each sequence whose
chunk has at least that many queries here.

Chunked prefill: the queries are the last n of a sequence's L context tokens, all already in the paged cache.
The context is walked in segments of at most ``segment`` keys; each segment's latents are gathered from their
pages, expanded by one GEMM into ``[S, H, Dn + Dv]`` (the workspace is bounded by the segment, not by L: 1M
tokens at H = 96 would be 48 GiB expanded at once) and attended by ``_expanded_kernel``: one program per (BM
query rows, head) walks the segment's keys in BN blocks with an online softmax (log2 domain, fp32 accumulators),
unmasked below the first query's position and causally masked on the diagonal blocks. Between segments the
running (max, sum, acc) of every (query, head) lives in fp32 buffers; the last segment normalises, multiplies by
``sigmoid(gate)`` when a gate is given (K3's output gate, ``[T, H, Dv]`` logits) and stores in q's dtype.

Math (fp32), sequence i, query j at position p = L - n + j, key l <= p::

    s = scale * (q_nope[j, h] . (c_kv[l] @ W_uk[h]^T) + q_pe[j, h] . k_pe[l]),  out = softmax_l(s) @ (c_kv @ W_uv[h]^T)

which is ``rocm_k3.ops.mla._mla_prefill_reference`` (times sigmoid(gate) with a gate). The host reads
``cu_seqlens_q`` and ``seq_lens`` once (a sync per call, as the absorbed kernel does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rocm_k3.ops.mla import (  # noqa: F401 (EXPANDED_MIN_QUERIES, SEGMENT_KEYS: re-exported)
    EXPANDED_MIN_QUERIES,
    SEGMENT_KEYS,
    expand_segment,
    prefill_geometry,
)
from rocm_k3.triton_kernels.runtime import interpreted

_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _attend_block(q, qpe, kn_ptr, v_ptr, pe_ptr, n0, hi, key0, h, stride_kt, stride_kh, stride_pe,
                  dn, dnmask, dr, drmask, dv, dvmask, m, l_sum, acc, pos_q, scale_log2,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` of the segment (``< hi``; absolute positions ``key0 + n0 + j``) into the online
    softmax of BM query rows at positions ``pos_q``; MASKED applies the causal mask (the diagonal blocks). All
    offsets are int32 (AMD buffer loads): the host keeps a segment's K/V and latents under 2^31 elements."""
    j = tl.arange(0, BLOCK_N)
    kmask = n0 + j < hi
    row = n0 * stride_kt + h * stride_kh  # scalar, int32: the host keeps a segment under 2^31 elements
    k = tl.load(kn_ptr + row + (j[:, None] * stride_kt + dn[None, :]),
                mask=kmask[:, None] & dnmask[None, :], other=0.0)  # [BN, DN]
    kpe = tl.load(pe_ptr + n0 * stride_pe + (j[:, None] * stride_pe + dr[None, :]),
                  mask=kmask[:, None] & drmask[None, :], other=0.0)  # [BN, DR]
    v = tl.load(v_ptr + row + (j[:, None] * stride_kt + dv[None, :]),
                mask=kmask[:, None] & dvmask[None, :], other=0.0)  # [BN, DV]
    if DOT_F32:  # the interpreter's bf16 tl.dot is wrong
        k = k.to(tl.float32)
        kpe = kpe.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.dot(qpe, tl.trans(kpe), s, input_precision="ieee")  # [BM, BN]
    s = s * scale_log2
    if MASKED:
        s = tl.where((key0 + n0 + j[None, :] <= pos_q[:, None]) & kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_sum, acc


@triton.jit
def _expanded_kernel(q_ptr, kn_ptr, v_ptr, pe_ptr, gate_ptr, out_ptr, acc_ptr, ml_ptr,
                     n_q, q_pos0, key0, seg_len, scale_log2,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_pe, stride_gt, stride_gh,
                     stride_ot, stride_oh,
                     NOPE: tl.constexpr, ROPE: tl.constexpr, VD: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr,
                     DV: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, HAS_GATE: tl.constexpr,
                     DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # q rows 0..n_q of one sequence at absolute positions q_pos0 + row; keys key0 .. key0 + seg_len (this segment,
    # pointers already at its first key); acc [n_q, H, DV] fp32 and ml [n_q, H, 2] fp32 carry the state between
    # segments (unused when FIRST and LAST)
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BM]
    rmask = rows < n_q
    r64 = rows.to(tl.int64)
    dn = tl.arange(0, DN)
    dr = tl.arange(0, DR)
    dv = tl.arange(0, DV)
    dnmask = dn < NOPE
    drmask = dr < ROPE
    dvmask = dv < VD
    q = tl.load(q_ptr + r64[:, None] * stride_qt + h * stride_qh + dn[None, :],
                mask=rmask[:, None] & dnmask[None, :], other=0.0)  # [BM, DN]
    qpe = tl.load(q_ptr + r64[:, None] * stride_qt + h * stride_qh + NOPE + dr[None, :],
                  mask=rmask[:, None] & drmask[None, :], other=0.0)  # [BM, DR]
    if DOT_F32:
        q = q.to(tl.float32)
        qpe = qpe.to(tl.float32)
    state = r64 * num_heads + h  # [BM] row of the state buffers
    if FIRST:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, DV), tl.float32)
    else:
        m = tl.load(ml_ptr + state * 2, mask=rmask, other=float("-inf"))
        l_sum = tl.load(ml_ptr + state * 2 + 1, mask=rmask, other=0.0)
        acc = tl.load(acc_ptr + state[:, None] * DV + dv[None, :], mask=rmask[:, None], other=0.0)
    pos_q = q_pos0 + rows  # [BM] absolute positions
    last_pos = q_pos0 + tl.minimum(m0 + BLOCK_M, n_q) - 1
    hi = tl.minimum(seg_len, last_pos - key0 + 1)  # keys of this segment seen by the block's last row
    free = tl.minimum(hi, q_pos0 + m0 - key0 + 1)  # keys every row of the block sees
    free = tl.maximum(free, 0) // BLOCK_N * BLOCK_N
    for n0 in range(0, free, BLOCK_N):  # below the diagonal: no mask
        m, l_sum, acc = _attend_block(q, qpe, kn_ptr, v_ptr, pe_ptr, n0, hi, key0, h, stride_kt, stride_kh,
                                      stride_pe, dn, dnmask, dr, drmask, dv, dvmask, m, l_sum, acc, pos_q,
                                      scale_log2, BLOCK_N, False, DOT_F32)
    for n0 in range(free, hi, BLOCK_N):  # the diagonal blocks
        m, l_sum, acc = _attend_block(q, qpe, kn_ptr, v_ptr, pe_ptr, n0, hi, key0, h, stride_kt, stride_kh,
                                      stride_pe, dn, dnmask, dr, drmask, dv, dvmask, m, l_sum, acc, pos_q,
                                      scale_log2, BLOCK_N, True, DOT_F32)
    if LAST:
        o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        omask = rmask[:, None] & dvmask[None, :]
        if HAS_GATE:
            g = tl.load(gate_ptr + r64[:, None] * stride_gt + h * stride_gh + dv[None, :], mask=omask,
                        other=0.0).to(tl.float32)
            o = o * tl.sigmoid(g)
        tl.store(out_ptr + r64[:, None] * stride_ot + h * stride_oh + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(ml_ptr + state * 2, m, mask=rmask)
        tl.store(ml_ptr + state * 2 + 1, l_sum, mask=rmask)
        tl.store(acc_ptr + state[:, None] * DV + dv[None, :], acc, mask=rmask[:, None])


def _tile(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def default_tiles(dtype: torch.dtype, amd: bool = False) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages). NVIDIA bf16/fp16: 128 x 128 with 8 warps, 2 stages (the best of
    five measured on the H200 at n = L = 8192, 12 heads: 0.95 ms against 1.08-1.78 ms; benchmarks/RESULTS.md); fp32
    operands 64 x 32 (twice the bytes per element). AMD: 32 x 32 with 4 warps, the
    largest tile gfx942 / gfx950 compile without scratch (the compile tier; 64 x 64 spills 25 registers, 128 x 64
    over 100: the resident q / q_pe tiles of 192 columns plus the 128-column accumulator); not measured on an AMD
    GPU."""
    if amd:
        return (32, 32, 4, 2)
    return (64, 32, 4, 2) if dtype == torch.float32 else (128, 128, 8, 2)


def mla_prefill_expanded(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, kv_b_weight: torch.Tensor, *,
                         scale: float | None = None, gate: torch.Tensor | None = None,
                         sequences: list[int] | None = None, out: torch.Tensor | None = None,
                         segment: int = SEGMENT_KEYS, tiles: tuple[int, int, int, int] | None = None,
                         bounds: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """Causal MLA prefill over the expanded heads -> ``[T, H, Dv]`` in q's dtype (``mla_prefill``'s contract,
    times ``sigmoid(gate)`` when ``gate [T, H, Dv]`` is given).

    ``sequences`` limits the call to those sequence indices (the others' rows of ``out`` are left as they are);
    ``out`` is written in place when given; ``segment`` bounds the keys expanded at once; ``tiles`` overrides
    :func:`default_tiles`; ``bounds`` = (cu_seqlens_q, seq_lens) already read on the host.
    """
    tokens, num_heads, q_width = q.shape
    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    nope, rope, vd = geo.nope, geo.rope, geo.v
    if segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    if gate is not None and tuple(gate.shape) != (tokens, num_heads, vd):
        raise ValueError(f"gate must have shape [T, H, Dv] = {[tokens, num_heads, vd]}, got {list(gate.shape)}")
    if out is None:
        out = torch.zeros(tokens, num_heads, vd, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    scale = q_width ** -0.5 if scale is None else float(scale)
    cu, lens = bounds if bounds is not None else (cu_seqlens_q.tolist(), seq_lens.tolist())
    bm, bn, warps, stages = tiles or default_tiles(q.dtype, amd=torch.version.hip is not None)
    segment = min(segment, (2 ** 31 - 1) // max(num_heads * (nope + vd), geo.latent))  # int32 offsets (kernel)
    compute = torch.float32 if q.dtype == torch.float32 else q.dtype
    w = kv_b_weight.to(compute)  # [H (Dn + Dv), R]
    q = q if q.stride(-1) == 1 else q.contiguous()
    dot_f32 = interpreted(_expanded_kernel)
    for i in range(len(lens)) if sequences is None else sequences:
        q0, q1, length = cu[i], cu[i + 1], lens[i]
        n = q1 - q0
        if n == 0:
            continue
        single = length <= segment
        acc = ml = out  # placeholders when one segment holds the whole context (never read)
        if not single:
            acc = torch.empty(n, num_heads, _tile(vd), dtype=torch.float32, device=q.device)
            ml = torch.empty(n, num_heads, 2, dtype=torch.float32, device=q.device)
        g = gate[q0:q1] if gate is not None else out
        for key0 in range(0, length, segment):
            count = min(segment, length - key0)
            kv, latent = expand_segment(kv_cache, block_table[i], key0, count, w, compute)
            kv = kv.view(count, num_heads, nope + vd)
            pe = latent[:, geo.kv_lora_rank:]  # [count, P], row stride R + P
            _expanded_kernel[(triton.cdiv(n, bm), num_heads)](
                q[q0:q1], kv, kv[:, :, nope:], pe, g, out[q0:q1], acc, ml,
                n, length - n, key0, count, scale * _LOG2E,
                q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), pe.stride(0), g.stride(0), g.stride(1),
                out.stride(0), out.stride(1),
                NOPE=nope, ROPE=rope, VD=vd, DN=_tile(nope), DR=_tile(rope), DV=_tile(vd),
                FIRST=key0 == 0, LAST=key0 + count >= length, HAS_GATE=gate is not None, DOT_F32=dot_f32,
                BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
            )
    return out
