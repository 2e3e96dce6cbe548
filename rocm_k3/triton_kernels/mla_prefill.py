"""MLA prefill and the paged-cache write on Triton (K3_SPEC §3, NoPE).

``mla_write_cache``: one program per token copies its R + P latent values to flat slot ``slot_mapping[t]``
(-1 skips; slots outside the cache are dropped: the reference raises on them, the kernel cannot without a sync).

``mla_prefill`` computes the expanded attention of the contract in the absorbed latent space, which is the same
function (associativity): with ``W_uk[h] [Dn, R], W_uv[h] [Dv, R]`` head h's rows of kv_b_weight,
    q_lat[t, h] = q_nope[t, h] @ W_uk[h]                                  [R]    (torch matmul)
    s[t, h, l]  = scale * (q_lat[t, h] . c_kv[l] + q_pe[t, h] . k_pe[l]),  l <= pos(t)
    o_lat[t, h] = softmax_l(s) @ c_kv                                     [R]    (``_mla_prefill_kernel``)
    out[t, h]   = o_lat[t, h] @ W_uv[h]^T                                 [Dv]   (torch matmul)
so no [L, H, Dn + Dv] expanded keys/values are materialised. One program per (BT query tokens of one sequence,
head) walks keys 0..(its last query's position) over the paged cache with an online softmax. The host reads
``cu_seqlens_q`` once to list the query blocks (a sync per prefill call).

``mla_prefill`` runs this kernel for the sequences of a call whose chunk is shorter than
``mla_prefill_expanded.EXPANDED_MIN_QUERIES`` queries and the expanded-heads flash kernel
(:mod:`rocm_k3.triton_kernels.mla_prefill_expanded`) for the others (the crossover measured on the H200).

Latent geometry (R, P, Dn, Dv; K3: 512, 64, 128, 128) comes from the shapes (``rocm_k3.ops.mla.prefill_geometry``);
the kernel takes R, P and Dn as constexprs with power-of-two column tiles, like the decode kernel, and declines the
same latents (``latent_supported``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_k3.ops.mla import prefill_geometry
from rocm_k3.triton_kernels.mla_decode import attend_latent, latent_supported, latent_tiles
from rocm_k3.triton_kernels.mla_prefill_expanded import EXPANDED_MIN_QUERIES, mla_prefill_expanded
from rocm_k3.triton_kernels.runtime import interpreted

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _write_cache_kernel(latent_ptr, cache_ptr, slot_ptr, capacity, stride_lat, D: tl.constexpr,
                        BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)  # int64
    if (slot >= 0) & (slot < capacity):
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        v = tl.load(latent_ptr + t.to(tl.int64) * stride_lat + cols, mask=mask)
        tl.store(cache_ptr + slot * D + cols, v, mask=mask)


def mla_write_cache(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``latent [T, R + P]`` -> ``kv_cache.view(-1, R + P)[slot_mapping[t]]`` in place (``-1`` skips)."""
    tokens, dim = latent.shape
    if tokens == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    _write_cache_kernel[(tokens,)](latent, kv_cache, slot_mapping, kv_cache.shape[0] * kv_cache.shape[1],
                                   latent.stride(0), D=dim, BLOCK=triton.next_power_of_2(dim))


@triton.jit
def _mla_prefill_kernel(qlat_ptr, q_ptr, kv_ptr, bt_ptr, cu_ptr, lens_ptr, blocks_ptr, out_ptr,
                        block_size, scale, stride_ql_t, stride_ql_h, stride_q_t, stride_q_h, stride_kvb, stride_kvt,
                        stride_btn, stride_o_t, stride_o_h,
                        DOT_F32: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                        DR: tl.constexpr, NOPE_DIM: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr):
    # D, DR: power-of-two tiles of the LORA c_kv and ROPE k_pe columns (columns past LORA / ROPE load as 0)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(blocks_ptr + 2 * pid)
    q0 = tl.load(blocks_ptr + 2 * pid + 1)
    q_end = tl.load(cu_ptr + seq + 1)
    length = tl.load(lens_ptr + seq)
    t = q0 + tl.arange(0, BT)  # [BT] query rows
    rmask = t < q_end
    pos_q = t - q_end + length  # [BT] absolute positions
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)
    dr = tl.arange(0, DR)
    dmask = d < LORA
    pmask_cols = dr < ROPE
    q = tl.load(qlat_ptr + t64[:, None] * stride_ql_t + h * stride_ql_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    qpe = tl.load(q_ptr + t64[:, None] * stride_q_t + h * stride_q_h + NOPE_DIM + dr[None, :],
                  mask=rmask[:, None] & pmask_cols[None, :], other=0.0)
    if DOT_F32:  # the interpreter's bf16 tl.dot is wrong
        q = q.to(tl.float32)
        qpe = qpe.to(tl.float32)
    else:
        qpe = qpe.to(q.dtype)
    hi = tl.minimum(q0 + BT, q_end) - q_end + length  # keys needed by the last query of the block
    _, l_sum, acc = attend_latent(q, qpe, kv_ptr, bt_ptr, seq, 0, hi, pos_q, scale, d, dr, dmask, pmask_cols,
                                  block_size, stride_btn, stride_kvb, stride_kvt, BT, BLOCK_N, D, LORA, True)
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + t64[:, None] * stride_o_t + h * stride_o_h + d[None, :], o,
             mask=rmask[:, None] & dmask[None, :])


def mla_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens: torch.Tensor, kv_b_weight: torch.Tensor, *, scale: float | None = None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA prefill: ``q [T, H, Dn + P]`` over the paged cache -> ``[T, H, Dv]`` in q's dtype (module doc),
    times ``sigmoid(gate [T, H, Dv])`` when a gate is given.

    Sequences whose chunk holds at least ``EXPANDED_MIN_QUERIES`` queries run over the expanded heads
    (:mod:`rocm_k3.triton_kernels.mla_prefill_expanded`, the gate fused into its epilogue), the others in the
    absorbed latent space (the gate applied to the fp32 W_uv product, before the one rounding)."""
    return mla_prefill_with(q, kv_cache, block_table, cu_seqlens_q, seq_lens, kv_b_weight, scale=scale, gate=gate)


def mla_prefill_with(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor, kv_b_weight: torch.Tensor, *, scale: float | None = None,
                     expanded_min_queries: int | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mla_prefill` with the crossover explicit (None = ``EXPANDED_MIN_QUERIES``; 0 = every sequence
    expanded; a value above every chunk = all absorbed)."""
    threshold = EXPANDED_MIN_QUERIES if expanded_min_queries is None else expanded_min_queries
    tokens, num_heads, q_width = q.shape
    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    lora, nope = geo.kv_lora_rank, geo.nope
    d_tile, dr_tile = latent_tiles(lora, geo.rope)
    scale = q_width ** -0.5 if scale is None else float(scale)
    out = torch.zeros(tokens, num_heads, geo.v, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    cu = cu_seqlens_q.tolist()
    long = [i for i in range(len(cu) - 1) if cu[i + 1] - cu[i] >= max(threshold, 1)]
    if long:
        mla_prefill_expanded(q, kv_cache, block_table, cu_seqlens_q, seq_lens, kv_b_weight, scale=scale,
                             gate=gate, sequences=long, out=out, bounds=(cu, seq_lens.tolist()))
    short_seqs = [i for i in range(len(cu) - 1) if i not in set(long)]
    bt_rows = 16
    blocks = [(i, s) for i in short_seqs for s in range(cu[i], cu[i + 1], bt_rows)]
    if not blocks:
        return out
    w = kv_b_weight.view(num_heads, nope + geo.v, lora)  # [H, Dn + Dv, R]
    compute = torch.float32 if q.dtype == torch.float32 else q.dtype
    q_lat = torch.einsum("thd,hdc->thc", q[..., :nope].to(compute), w[:, :nope].to(compute))  # [T, H, R]
    q_lat = q_lat.contiguous()
    block_list = torch.tensor(blocks, dtype=torch.int32, device=q.device)  # [NB, 2] (sequence, first query row)
    o_lat = torch.empty(tokens, num_heads, lora, dtype=torch.float32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    _mla_prefill_kernel[(len(blocks), num_heads)](
        q_lat, q, kv_cache, block_table, cu_seqlens_q, seq_lens, block_list, o_lat,
        kv_cache.shape[1], scale, q_lat.stride(0), q_lat.stride(1), q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), o_lat.stride(0), o_lat.stride(1),
        DOT_F32=interpreted(_mla_prefill_kernel), BT=bt_rows, BLOCK_N=32, D=d_tile, DR=dr_tile, NOPE_DIM=nope,
        LORA=lora, ROPE=geo.rope, num_warps=4, num_stages=2,
    )
    short = torch.einsum("thc,hdc->thd", o_lat, w[:, nope:].float())  # [T, H, Dv]
    if gate is not None:
        short = short * torch.sigmoid(gate.float())
    if not long:
        return short.to(q.dtype)
    rows = torch.tensor([t for i in short_seqs for t in range(cu[i], cu[i + 1])], device=q.device)
    out[rows] = short[rows].to(q.dtype)
    return out


def mla_write_cache_supports(latent, kv_cache, slot_mapping) -> tuple[bool, str]:
    if not kv_cache.is_contiguous():
        return False, "kv_cache must be contiguous"
    return True, "supported"


def mla_prefill_supports(q, kv_cache, block_table, cu_seqlens_q, seq_lens, kv_b_weight, *, scale=None, gate=None):
    if q.dtype not in _FLOAT_DTYPES:
        return False, f"q must be bf16/fp16/fp32, got {q.dtype}"
    if kv_cache.stride(-1) != 1:
        return False, "kv_cache must have a contiguous last dim"
    geo = prefill_geometry(q, kv_cache, kv_b_weight)
    return latent_supported(geo.kv_lora_rank, geo.rope)


KERNELS = {
    "mla_write_cache": (mla_write_cache, mla_write_cache_supports),
    "mla_prefill": (mla_prefill, mla_prefill_supports),
}
