"""Absorbed MLA decode over the paged latent cache (K3_SPEC §3), optionally split over KV ranges.

Per sequence i, head h (fp32 accumulation):
    s[l]   = scale * (q_latent[h] . c_kv[l] + q_pe[h] . k_pe[l])      l < seq_lens[i]
    out[h] = softmax(s) @ c_kv                                        [R], in q's dtype

``_mla_decode_kernel`` runs one program per (sequence, BH heads, KV split); it walks its token range in tiles
of BLOCK_N (each token's page from ``block_table``), keeps an online softmax, and either writes the normalised
output (one split) or its partial (acc / l, log-sum-exp) to an fp32 workspace that ``_mla_combine_kernel``
merges. Cache row layout: R c_kv | P k_pe (K3: 512 | 64).

Latent geometry: R = kv_lora_rank and P = rope width are constexprs (``LORA``, ``ROPE``) read from the tensor
shapes; the tiles are their next powers of two (at least 16, the MMA K), with masked columns loaded as 0, so any
R, P up to the released sizes run here. Larger latents are declined by :func:`mla_decode_supports` (their fp32
[BH, R] accumulators would not fit the tile's registers; not validated) and dispatch falls back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_k3.triton_kernels.runtime import interpreted

MAX_LORA_TILE = 512  # the released kv_lora_rank: the largest latent tile these kernels were sized and measured at
MAX_ROPE_TILE = 64
_MIN_TILE = 16  # tl.dot needs K >= 16
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def latent_tiles(lora: int, rope: int) -> tuple[int, int]:
    """The power-of-two column tiles (>= 16) that hold ``lora`` c_kv and ``rope`` k_pe columns."""
    return max(_MIN_TILE, triton.next_power_of_2(lora)), max(_MIN_TILE, triton.next_power_of_2(rope))


def latent_supported(lora: int, rope: int) -> tuple[bool, str]:
    """Whether the MLA kernels take this latent geometry, and why not (shared by decode and prefill)."""
    d, dr = latent_tiles(lora, rope)
    if d > MAX_LORA_TILE or dr > MAX_ROPE_TILE:
        return False, (f"kv_lora_rank {lora} / rope {rope} need {d} / {dr}-wide tiles; the Triton MLA kernels take "
                       f"at most {MAX_LORA_TILE} / {MAX_ROPE_TILE} (their fp32 accumulators are sized for the "
                       "released latent)")
    return True, "supported"


@triton.jit
def attend_latent(q, qpe, kv_ptr, bt_ptr, seq, lo, hi, pos_q, scale, d, dr, dmask, rmask, block_size, stride_btn,
                  stride_kvb, stride_kvt, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  LORA: tl.constexpr, CAUSAL: tl.constexpr):
    """Online-softmax attention of ROWS query rows (q [ROWS, D] latent, qpe [ROWS, DR] rope) over the cached
    positions [lo, hi) of sequence ``seq`` (paged through its block-table row), BLOCK_N keys a step; CAUSAL: row r
    sees positions <= pos_q[r] only. Returns (m, l_sum, acc [ROWS, D]) in fp32: the running max, the sum of
    exp(s - m) and the unnormalised output (a row that saw no key keeps l_sum 0)."""
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        kmask = pos < hi
        page = tl.load(bt_ptr + seq * stride_btn + pos // block_size, mask=kmask, other=0).to(tl.int64)
        row = kv_ptr + page * stride_kvb + (pos % block_size).to(tl.int64) * stride_kvt  # [BLOCK_N] row pointers
        c_kv = tl.load(row[:, None] + d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, D]
        k_pe = tl.load(row[:, None] + LORA + dr[None, :], mask=kmask[:, None] & rmask[None, :],
                       other=0.0)  # [BLOCK_N, DR]
        c_kv = c_kv.to(q.dtype)  # fp32 when the kernel computes in fp32 (DOT_F32), else a no-op or q's dtype
        k_pe = k_pe.to(qpe.dtype)
        s = tl.dot(q, tl.trans(c_kv), input_precision="ieee")  # [ROWS, BLOCK_N]; IEEE: no TF32 for fp32 operands
        s += tl.dot(qpe, tl.trans(k_pe), input_precision="ieee")
        if CAUSAL:
            seen = (pos[None, :] <= pos_q[:, None]) & kmask[None, :]
        else:
            seen = kmask[None, :]
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision="ieee")
        m = m_new
    return m, l_sum, acc


@triton.jit
def _mla_decode_kernel(q_ptr, qpe_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
                       num_heads, block_size, scale,
                       stride_qn, stride_qh, stride_pn, stride_ph, stride_kvb, stride_kvt, stride_btn,
                       stride_on, stride_oh,
                       SPLITS: tl.constexpr, DOT_F32: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr,
                       D: tl.constexpr, DR: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr):
    # D, DR: power-of-two tiles of the LORA c_kv and ROPE k_pe columns (columns past LORA / ROPE load as 0)
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)  # [BH]
    split = tl.program_id(2)
    hmask = heads < num_heads
    d = tl.arange(0, D)
    dr = tl.arange(0, DR)
    dmask = d < LORA
    rmask = dr < ROPE
    q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + seq * stride_pn + heads[:, None] * stride_ph + dr[None, :],
                  mask=hmask[:, None] & rmask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        qpe = qpe.to(tl.float32)
    length = tl.load(lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)
    m, l_sum, acc = attend_latent(q, qpe, kv_ptr, bt_ptr, seq, lo, hi, hi, scale, d, dr, dmask, rmask, block_size,
                                  stride_btn, stride_kvb, stride_kvt, BH, BLOCK_N, D, LORA, False)
    omask = hmask[:, None] & dmask[None, :]
    if SPLITS == 1:
        o = acc / l_sum[:, None]
        tl.store(out_ptr + seq * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        base = (seq * num_heads + heads) * SPLITS + split  # [BH] workspace rows of LORA values
        safe_l = tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(part_ptr + base[:, None].to(tl.int64) * LORA + d[None, :], acc / safe_l[:, None], mask=omask)
        tl.store(lse_ptr + base, tl.where(l_sum > 0, m + tl.log(safe_l), float("-inf")), mask=hmask)


@triton.jit
def _mla_combine_kernel(part_ptr, lse_ptr, out_ptr, num_heads, stride_on, stride_oh,
                        SPLITS: tl.constexpr, D: tl.constexpr, LORA: tl.constexpr):
    """out[seq, h] = sum_s exp(lse_s - LSE) * part_s over the KV splits (empty splits have lse = -inf)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    base = (seq * num_heads + h) * SPLITS
    lse = tl.load(lse_ptr + base + sp)  # [SPLITS]
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    d = tl.arange(0, D)
    dmask = d < LORA
    part = tl.load(part_ptr + (base + sp)[:, None].to(tl.int64) * LORA + d[None, :], mask=dmask[None, :],
                   other=0.0)  # [SPLITS, D]
    o = tl.sum(part * w[:, None], axis=0)
    tl.store(out_ptr + seq * stride_on + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def _num_splits(n: int, head_blocks: int, max_len: int) -> int:
    """Enough programs to fill ~264 SM slots, at most one split per 256 tokens and 16 splits."""
    want = triton.cdiv(264, max(1, n * head_blocks))
    return max(1, min(16, want, triton.cdiv(max_len, 256)))


def mla_decode_with(q_latent, q_pe, kv_cache, block_table, seq_lens, *, scale: float, splits: int | None = None,
                    block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """:func:`mla_decode` with explicit KV splits / tile sizes (tests and benchmarks).

    splits: KV ranges per (sequence, head block), rounded up to a power of two; None picks by occupancy.
    block_h (heads per program) and block_n (keys per step): powers of two >= 16 (the MMA tile).
    """
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 64):
        raise ValueError(f"splits must be None or an int in [1, 64], got {splits!r}")
    for name, value in (("block_h", block_h), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    n, num_heads, lora = q_latent.shape
    rope = q_pe.shape[2]
    d_tile, dr_tile = latent_tiles(lora, rope)
    out = torch.empty_like(q_latent)
    if n == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    if splits is None:
        splits = _num_splits(n, head_blocks, block_table.shape[1] * kv_cache.shape[1])
    splits = triton.next_power_of_2(splits)
    if splits > 1:
        part = torch.empty(n * num_heads * splits, lora, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(n * num_heads * splits, dtype=torch.float32, device=q_latent.device)
    else:
        part = lse = out
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    _mla_decode_kernel[(n, head_blocks, splits)](
        q_latent, q_pe, kv_cache, block_table, seq_lens, out, part, lse,
        num_heads, kv_cache.shape[1], float(scale),
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        SPLITS=splits, DOT_F32=interpreted(_mla_decode_kernel), BH=block_h, BLOCK_N=block_n, D=d_tile,
        DR=dr_tile, LORA=lora, ROPE=rope, num_warps=4, num_stages=2,
    )
    if splits > 1:
        _mla_combine_kernel[(n, num_heads)](part, lse, out, num_heads, out.stride(0), out.stride(1),
                                            SPLITS=splits, D=d_tile, LORA=lora, num_warps=4)
    return out


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``q_latent [N, H, R]``, ``q_pe [N, H, P]``, paged ``kv_cache [B, bs, R + P]`` -> ``[N, H, R]``."""
    return mla_decode_with(q_latent, q_pe, kv_cache, block_table, seq_lens, scale=scale)


def mla_decode_supports(q_latent, q_pe, kv_cache, block_table, seq_lens, *, scale) -> tuple[bool, str]:
    if q_latent.dtype not in _FLOAT_DTYPES:
        return False, f"q_latent must be bf16/fp16/fp32, got {q_latent.dtype}"
    if kv_cache.stride(-1) != 1:
        return False, "kv_cache must have a contiguous last dim"
    return latent_supported(q_latent.shape[2], q_pe.shape[2])


KERNELS = {"mla_decode": (mla_decode, mla_decode_supports)}
