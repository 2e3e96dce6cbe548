"""Phases 1 and 2 of the chunked KDA prefill in one launch (``prefill.PREP_IN_INTRA``): chunk_prep's per-token work
done by chunk_intra's programs for the rows they need, one program per (chunk, 16-row sub-block I, head).

Program (c, I, h) reads the raw inputs (q, k at their token-row strides, the gate input g, beta) and, with
g = kda_gate(f) (or the given fp32 log-decay), m the reference row of chunk_intra (the block's 8th row, or its last
row in a short chunk) and the carry C_I = sum of g over the chunk's rows before block I::

    Gr_I  = cumsum(g_I)                      G relative to the block's start (G_I = C_I + Gr_I)
    S_J   = C_I - G_J = sum of g over the rows after each row of block J < I, up to block I   (J nearest first)
    q', k', b                                as chunk_prep (L2 norm over all K columns of a row, scale, sigmoid)
    A_IJ, Aqk_IJ                             as chunk_intra, with G_I - G_m = Gr_I - Gr_m and G_m - G_J = Gr_m + S_J
    QG = q' exp(G_I),  KD = k' exp(G_last - G_I),  KB = b exp(G_I) k',  b      for block I's rows
    GL = exp(G_last)                         by the I = 0 program (it exists for every chunk)

and writes A (fp32) and Aqk as [T, H, 64] row bands (zeros above the diagonal blocks), KB, QG, KD (activation
dtype), b (fp32 [T, H]) and GL (fp32 [NC, H, K]) -- everything chunk_solve (KB semantics) and chunk_state read;
q', k' and G never go to memory. Order of work: the gate of block I (Gr_I, m), the later blocks' gate sums
(G_last - C_I), b and KD, the diagonal products, then the earlier blocks J = I - 1 .. 0 (their gate, S_J, k'_J and
products; C_I accumulates on the way), then QG and KB. Each of a chunk-head's four programs reads the whole chunk's
gate input (the block sums give C_I and G_last): 4x chunk_prep's gate arithmetic, the re-reads hitting L2; block I's
q and k rows are read twice (before and after the loop: fewer live registers than holding q', k' across it). Rows
past a sequence's end are masked as in chunk_intra (their g is 0, so Gr is flat there and m falls on the last
valid row).

Registers (sm_90 / gfx942 / gfx950 cross-compiles, bf16, K = 128, 4 warps, 1 stage): 147 / 154 / 148, no spills
(chunk_prep_split 64 and chunk_intra_kb 130 on sm_90). The earlier blocks' products take the row operands stacked
(chunk_intra.stacked_pair_products): with the two [16, K] operands separate, every warp held both whole across the
loop and the kernel needed 238 registers on sm_90.

Numerics: q' and k' stay fp32 until the dot operand cast (chunk_prep stores them in the activation dtype for
chunk_intra), and the decay exponents are formed from block-relative sums (16 rows) instead of differences of
chunk-wide cumulative sums (64 rows): the same values up to fp32 rounding, from smaller operands. The range is
chunk_intra's (every factor is within 8 steps of decay of a reference row, or <= 1). Tolerances of the prefill's
tests are the default path's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_intra import (_decay, _load_rows, pair_products, stack_rows,
                                                   stacked_pair_products, store_band_block, zero_band_above)
from rocm_k3.triton_kernels.kda.chunk_solve import invert_diagonal_block
from rocm_k3.triton_kernels.kda.common import chunk_bounds, gate_block, grid_ids, sigmoid_f32


@triton.jit
def _normed_rows(x_ptr, row0, eos, stride, factor, K: tl.constexpr, QK_NORM: tl.constexpr):
    """(factor * x[row0 .. row0 + 15] (divided by its L2 norm per row when QK_NORM) as fp32 [16, K], rows past eos
    0; the row mask [16, 1])."""
    x, m = _load_rows(x_ptr, row0, eos, stride, K, 16)
    x = x.to(tl.float32)
    if QK_NORM:
        return x * (factor / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None], m
    return x * factor, m


@triton.jit
def chunk_prep_intra_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr,  # q, k [T, H, K] (row strides below); g [T, H, K] (log-decay or raw f); beta [T, H]
    a_log_ptr, dt_bias_ptr,  # gate parameters: fp32 [H], fp32 [H*K] (read only when HAS_GATE)
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan (int32)
    a_ptr, aqk_ptr, kb_ptr, beta_out_ptr,  # outputs: A fp32 [T, H, 64]; Aqk [T, H, 64]; KB [T, H, K]; b fp32 [T, H]
    qg_ptr, kd_ptr, glast_ptr,  # outputs: QG, KD [T, H, K]; GL fp32 [NC, H, K]
    scale, lower_bound,  # fp32 scalars
    stride_q, stride_k,  # token-row strides of q and k in elements (head stride K, element stride 1)
    H: tl.constexpr, K: tl.constexpr,
    HAS_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, QK_NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr, INVERT_DIAG: tl.constexpr, INVERT_PRODUCTS: tl.constexpr,
):
    """Grid (NC * 4, H), sub-block fastest (common.grid_ids: a chunk-head's four programs run side by side and share
    their re-reads of q, k and g through L2). Programs whose block starts past the chunk's end write nothing."""
    BC: tl.constexpr = 16
    BT: tl.constexpr = 64
    c, h, blk = grid_ids(BT // BC)
    t0, n = chunk_bounds(chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, c, BT)  # rows t0 .. t0 + n - 1
    eos = t0 + n
    r0 = t0 + blk * BC  # first row of sub-block I
    if r0 < eos:
        sk = H * K
        q_h, k_h = q_ptr + h * K, k_ptr + h * K
        g_c = g_ptr + t0.to(tl.int64) * sk + h * K  # the chunk's first row of g
        a_log_h, dt_bias_h = a_log_ptr + h, dt_bias_ptr + h * K
        r = tl.arange(0, BC)
        rows = r0 + r
        m = rows < eos  # [BC]
        g = gate_block(g_c, a_log_h, dt_bias_h, n, lower_bound, blk, H, K, HAS_GATE, SAFE_GATE)  # [BC, K]
        gr = tl.cumsum(g, axis=0)  # G - C_I, flat past the chunk's end
        gm = tl.sum(tl.where(r[:, None] == 7, gr, 0.0), axis=0)  # [K] reference row, relative to C_I
        tail = tl.sum(g, axis=0)  # G_last - C_I: this block's sum, then the later blocks'
        for j in range(blk + 1, BT // BC):
            tail += tl.sum(gate_block(g_c, a_log_h, dt_bias_h, n, lower_bound, j, H, K, HAS_GATE, SAFE_GATE), axis=0)
        b = tl.load(beta_ptr + rows.to(tl.int64) * H + h, mask=m, other=0.0).to(tl.float32)  # [BC]
        if BETA_LOGITS:
            b = sigmoid_f32(b)
        b = tl.where(m, b, 0.0)
        tl.store(beta_out_ptr + rows.to(tl.int64) * H + h, b, mask=m)
        own = rows.to(tl.int64)[:, None] * sk + h * K + tl.arange(0, K)[None, :]  # [BC, K] in the contiguous outputs
        k_own, mk = _normed_rows(k_h, r0, eos, stride_k, 1.0, K, QK_NORM)  # [BC, K] fp32
        kdecay = tl.exp(tl.where(mk, tail[None, :] - gr, 0.0))  # exp(G_last - G) <= 1
        tl.store(kd_ptr + own, (k_own * kdecay).to(kd_ptr.dtype.element_ty), mask=mk)
        q_own, _ = _normed_rows(q_h, r0, eos, stride_q, scale, K, QK_NORM)
        kp = _decay(k_own, gr, gm, mk, 1.0).to(DOT_T)  # row operands [BC, K]
        qp = _decay(q_own, gr, gm, mk, 1.0).to(DOT_T)
        out_rows = rows.to(tl.int64)[:, None] * (H * BT) + h * BT + r[None, :]  # column block 0 of the band
        kn = tl.trans(_decay(k_own, gr, gm, mk, -1.0).to(DOT_T))  # diagonal block's column operand [K, BC]
        akk, aqk = pair_products(kp, qp, kn, b, True, PREC)
        if INVERT_DIAG:  # T_II stored after the loop, its operands dead (sm_90: 164 registers instead of 174)
            tl.store(aqk_ptr + out_rows + blk * BC, aqk.to(aqk_ptr.dtype.element_ty), mask=m[:, None])
        else:
            store_band_block(a_ptr, aqk_ptr, out_rows, blk, akk, aqk, m)
        zero_band_above(a_ptr, aqk_ptr, out_rows, blk, m)
        kq = stack_rows(kp, qp)  # [2 BC, K]: the earlier blocks' products (see stacked_pair_products)
        carry = tl.zeros([K], dtype=tl.float32)  # sum of g over blocks J .. I - 1: C_I after the loop
        for jj in range(0, blk):  # earlier sub-blocks, nearest first: k'_J exp(G_m - G_J) (factor <= 1)
            jb = blk - 1 - jj
            gj = gate_block(g_c, a_log_h, dt_bias_h, n, lower_bound, jb, H, K, HAS_GATE, SAFE_GATE)
            sj = tl.sum(gj, axis=0)
            s = (carry + sj)[None, :] - tl.cumsum(gj, axis=0)  # S_J = C_I - G_J [BC, K]
            kj, mj = _normed_rows(k_h, t0 + jb * BC, eos, stride_k, 1.0, K, QK_NORM)
            kn_j = tl.trans(_decay(kj, s, -gm, mj, 1.0).to(DOT_T))  # [K, BC] (own names: not loop-carried)
            a_j, aqk_j = stacked_pair_products(kq, kn_j, b, False, PREC)
            store_band_block(a_ptr, aqk_ptr, out_rows, jb, a_j, aqk_j, m)
            carry += sj
        eg = tl.exp(carry[None, :] + gr)  # exp(G) <= 1; q', k' read again (L1 / L2): fewer live registers
        q_own, _ = _normed_rows(q_h, r0, eos, stride_q, scale, K, QK_NORM)
        tl.store(qg_ptr + own, (q_own * eg).to(qg_ptr.dtype.element_ty), mask=mk)
        k_own, _ = _normed_rows(k_h, r0, eos, stride_k, 1.0, K, QK_NORM)
        tl.store(kb_ptr + own, (k_own * eg * b[:, None]).to(kb_ptr.dtype.element_ty), mask=mk)
        if INVERT_DIAG:  # chunk_intra's INVERT_DIAG: T_II = (I + A_II)^-1 in A's diagonal block
            t_ii = invert_diagonal_block(akk, BC, INVERT_PRODUCTS)
            tl.store(a_ptr + out_rows + blk * BC, t_ii.to(a_ptr.dtype.element_ty), mask=m[:, None])
        if blk == 0:  # C_0 = 0: tail is G_last
            tl.store(glast_ptr + (c * H + h).to(tl.int64) * K + tl.arange(0, K), tl.exp(tail))
