"""Phase 2 of the chunked KDA prefill: the in-chunk pair matrices, one program per (chunk, head, sub-block I).

With G the in-chunk cumulative log-decay and b = beta (fp32) from phase 1, q' and k' (from phase 1, or with RAW_QK
normalised here), for the C = 64 rows::

    A[i, j]   = b_i * sum_d k'_i[d] k'_j[d] exp(G_i[d] - G_j[d])      j <  i   (strictly lower), fp32
    Aqk[i, j] =       sum_d q'_i[d] k'_j[d] exp(G_i[d] - G_j[d])      j <= i   (activation dtype)

Both are written as [T, H, 64] row bands (row i of the chunk holds its 64 columns, zeros above the diagonal). With
``WRITE_KB`` the program also writes chunk_solve's right-hand side of W for its rows, KB = b * exp(G) * k' (the
activation dtype), so the solve reads one 2-byte tensor instead of k' and fp32 G. With ``INVERT_DIAG``
(``prefill.INTRA_INVERTS``, and always under ``prefill.SOLVE_IN_WALK``) the band's diagonal block holds T_II = (I +
A_II)^-1 instead of A_II (in fp32, row by row or, INVERT_PRODUCTS, by four-factor products), computed once here instead
of once per solve column block. With ``RAW_QK`` (``prefill.NORMS_IN_INTRA``, the default) the program reads the raw q
and k (at their token-row strides), computes the row factors itself from the full rows it loads (scale / ||q||, 1 /
||k||, the L2 norm only with QK_NORM; q' and k' reach the dot operands from fp32, one rounding less than through stored
copies) and also writes chunk_prep's QG = q' exp(G) and KD = k' exp(G_last - G) for its own rows (G_last: G at the
chunk's last row): chunk_prep then only gates and sums. The A band is stored in a_ptr's dtype: fp32, or the dot dtype
when the state walk solves (``prefill.BAND_IN_DOT_DTYPE``, the default: the walk rounds every A block to its dot
operands anyway).

Numerics: ``exp(G_i - G_j)`` cannot be split as ``exp(G_i) * exp(-G_j)`` over a whole chunk (64 steps of decay
overflow fp32), so the chunk is cut into four 16-row sub-blocks, each with a reference row m (its 8th row):
``exp(G_i - G_j) = exp(G_i - G_m) * exp(G_m - G_j)`` with m the reference of i's sub-block. For j in an earlier
sub-block the second factor is <= 1; inside one sub-block both factors stay within 8 steps of decay
(|exponent| <= 8 max|g|; K3's safe gate has |g| < 5, so <= 40, far from fp32's 88). With the softplus gate
this holds while per-token |g| < 11. With ``FACTORS`` (``prefill.GATE_FACTORS``) gcum_ptr holds chunk_prep's E = exp(G
- G_m) per sub-block (G_m the midpoint of its G range instead of its 8th row's G: as close to every row) and gref_ptr
G_m of the chunk's four sub-blocks and G_last (fp32 [NC, H, 5, K]); the factors are then products, no exponential per
element: exp(G_i - G_m) = E_i, exp(G_m - G_j) = exp(G_m - G_mJ) / E_j, exp(G_i) = E_i exp(G_m), exp(G_last - G_i) =
exp(G_last - G_m) / E_i (one exponential per column and sub-block, one reciprocal per element). Dot operands are bf16
for bf16 activations, else fp32 (fp16 cannot hold the sub-block factors, which reach exp(40)). ``FAST_EXP``
(``prefill.FAST_EXP``): the exponentials through common.exp_f32's FAST form. ``NEG_L`` (``prefill.WALK_HORNER``): the
band's blocks below the diagonal hold -L_IJ = -T_II A_IJ instead of A_IJ (chunk_state's HORNER operand).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_solve import invert_diagonal_block
from rocm_k3.triton_kernels.kda.common import exp_f32, grid_ids


@triton.jit
def _load_rows(x_ptr, row0, eos, stride, D: tl.constexpr, BC: tl.constexpr):
    """(x[row0 .. row0 + BC - 1, :D] as stored, rows past eos 0; the row mask [BC, 1])."""
    rows = row0 + tl.arange(0, BC)
    m = (rows < eos)[:, None]
    offs = rows.to(tl.int64)[:, None] * stride + tl.arange(0, D)[None, :]
    return tl.load(x_ptr + offs, mask=m, other=0.0), m


@triton.jit
def _qk_rows(x_ptr, row0, eos, stride, fscale, D: tl.constexpr, BC: tl.constexpr, RAW_QK: tl.constexpr,
             QK_NORM: tl.constexpr):
    """(q' or k' rows row0 .. row0 + BC - 1 [BC, D]; the row mask [BC, 1]) from x_ptr (rows past eos 0): q' / k' as
    stored, or (RAW_QK) the raw rows times their own factor fscale / sqrt(sum x^2 + 1e-6) (fscale without QK_NORM),
    fp32."""
    x, m = _load_rows(x_ptr, row0, eos, stride, D, BC)
    if RAW_QK:
        x = x.to(tl.float32)
        if QK_NORM:
            x = x * (fscale / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]
        else:
            x = x * fscale
    return x, m


@triton.jit
def _decay(x, g, gref, m, SIGN: tl.constexpr, FAST_EXP: tl.constexpr):
    """x * exp(SIGN * (g - gref)) as fp32; masked rows (m false) get exponent 0."""
    return x.to(tl.float32) * exp_f32(tl.where(m, SIGN * (g - gref[None, :]), 0.0), FAST_EXP)


@triton.jit
def _factor_rows(e_ptr, row0, eos, stride, D: tl.constexpr, BC: tl.constexpr):
    """(E rows row0 .. row0 + BC - 1 as fp32 [BC, D] (rows past eos 1), their reciprocals as rsqrt(E)^2: two
    instructions (rsqrt.approx / v_rsq_f32 and a multiply) where a division takes range checks)."""
    e, m = _load_rows(e_ptr, row0, eos, stride, D, BC)
    e = tl.where(m, e.to(tl.float32), 1.0)
    r = tl.math.rsqrt(e)
    return e, r * r


@triton.jit
def _keep_lower(a, aqk):
    """A's strictly lower and Aqk's lower part of a diagonal [16, 16] block."""
    r = tl.arange(0, 16)
    return tl.where(r[:, None] > r[None, :], a, 0.0), tl.where(r[:, None] >= r[None, :], aqk, 0.0)


@triton.jit
def pair_products(kp, qp, kn, b, DIAG: tl.constexpr, PREC: tl.constexpr):
    """(A_IJ fp32, Aqk_IJ fp32) of one [16, 16] block from the decayed row operands kp, qp [16, K] and the
    decayed column operand kn [K, 16]; DIAG (J = I) keeps A's strictly lower and Aqk's lower part."""
    a = tl.dot(kp, kn, input_precision=PREC) * b[:, None]
    aqk = tl.dot(qp, kn, input_precision=PREC)
    if DIAG:
        a, aqk = _keep_lower(a, aqk)
    return a, aqk


@triton.jit
def store_band_block(a_ptr, aqk_ptr, out_rows, J, a, aqk, m):
    """Column block J of the [T, H, 64] row bands: A and Aqk (each in its buffer's dtype) for the rows whose offsets of
    column 0 are out_rows [16, 16]; m: their row mask [16]."""
    tl.store(a_ptr + out_rows + J * 16, a.to(a_ptr.dtype.element_ty), mask=m[:, None])
    tl.store(aqk_ptr + out_rows + J * 16, aqk.to(aqk_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def zero_band_above(a_ptr, aqk_ptr, out_rows, I, m):
    """Zeros in the column blocks J > I (above the diagonal block) of sub-block I's row bands."""
    zero = tl.zeros([16, 16], dtype=tl.float32)
    for j in range(I + 1, 4):
        store_band_block(a_ptr, aqk_ptr, out_rows, j, zero, zero, m)


@triton.jit
def chunk_intra_kernel(
    qn_ptr, kn_ptr, gcum_ptr, beta_ptr,  # q', k' [T, H, K] from phase 1 (RAW_QK: the raw q, k at row strides
    # stride_q, stride_k), G fp32 [T, H, K] (FACTORS: chunk_prep's E, bf16 for bf16 activations), b fp32 [T, H]
    stride_q, stride_k, scale,  # RAW_QK: the raw q's and k's row strides and q's scale
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan
    a_ptr, aqk_ptr,  # outputs: A [T, H, 64] (fp32, or BAND_IN_DOT_DTYPE's dtype), Aqk [T, H, 64]
    kb_ptr,  # output when WRITE_KB: b * exp(G) * k' [T, H, K] (chunk_solve's right-hand side of W)
    qg_ptr, kd_ptr,  # outputs when RAW_QK: QG, KD [T, H, K] (chunk_prep's, see there)
    gref_ptr,  # with FACTORS: G_m of the four sub-blocks and G_last, fp32 [NC, H, 5, K] (gcum_ptr then holds E)
    H: tl.constexpr, K: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr, WRITE_KB: tl.constexpr,
    INVERT_DIAG: tl.constexpr, INVERT_PRODUCTS: tl.constexpr, RAW_QK: tl.constexpr, QK_NORM: tl.constexpr = True,
    FAST_EXP: tl.constexpr = False, FACTORS: tl.constexpr = False, NEG_L: tl.constexpr = False,
):
    """Grid (NC * 4, H), sub-block fastest (common.grid_ids: the four programs of a chunk-head re-read the earlier
    sub-blocks' rows from L2; H200 2026-12-04: 9-10 % faster than grid (NC, H, 4)). Sub-block I's own rows (k', q',
    G or, FACTORS, E) are read once and give the row operands, the diagonal block's column operand and (WRITE_KB) KB;
    the earlier sub-blocks' k' and G (E and G_m) are read for their column operands."""
    BC: tl.constexpr = 16
    BT: tl.constexpr = 64
    tl.static_assert(not RAW_QK or WRITE_KB, "RAW_QK writes QG and KD with KB: it needs WRITE_KB")
    tl.static_assert(not FACTORS or RAW_QK, "FACTORS comes from the gate-only prep (GATE_ONLY): it needs RAW_QK")
    tl.static_assert(not NEG_L or INVERT_DIAG, "NEG_L's -T_II A_IJ needs the inverted diagonal blocks")
    c, h, blk = grid_ids(BT // BC)
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    eos = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1), t0 + BT)  # end of this chunk
    r0 = t0 + blk * BC  # first row of sub-block I
    if r0 < eos:
        sk = H * K
        sq_in = sk  # row strides of the q and k read: q', k' contiguous, or the raw q, k as passed
        sk_in = sk
        if RAW_QK:
            sq_in = stride_q
            sk_in = stride_k
        k_ptr = kn_ptr + h * K
        g_ptr = gcum_ptr + h * K
        rows = r0 + tl.arange(0, BC)
        m = rows < eos
        r = tl.arange(0, BC)
        cols = tl.arange(0, K)
        ref_base = gref_ptr + (c * H + h).to(tl.int64) * (5 * K)  # FACTORS: G_m of sub-blocks 0-3, G_last
        if FACTORS:
            gm = tl.load(ref_base + blk * K + cols)
        else:
            gm = tl.load(g_ptr + tl.minimum(r0 + 7, eos - 1).to(tl.int64) * sk + cols)  # reference row
        b = tl.load(beta_ptr + rows.to(tl.int64) * H + h, mask=m, other=0.0)  # [BC]
        k_own, mk = _qk_rows(k_ptr, r0, eos, sk_in, 1.0, K, BC, RAW_QK, QK_NORM)  # k'
        q_own, _ = _qk_rows(qn_ptr + h * K, r0, eos, sq_in, scale, K, BC, RAW_QK, QK_NORM)
        if FACTORS:
            e_own, inv_own = _factor_rows(g_ptr, r0, eos, sk, K, BC)  # exp(G - G_m), exp(G_m - G)
            kp = (k_own * e_own).to(DOT_T)  # [BC, K]
            qp = (q_own * e_own).to(DOT_T)
            kn = tl.trans((k_own * inv_own).to(DOT_T))  # the diagonal block's column operand [K, BC]
        else:
            g_own, _ = _load_rows(g_ptr, r0, eos, sk, K, BC)  # fp32
            kp = _decay(k_own, g_own, gm, mk, 1.0, FAST_EXP).to(DOT_T)  # [BC, K]
            qp = _decay(q_own, g_own, gm, mk, 1.0, FAST_EXP).to(DOT_T)
            kn = tl.trans(_decay(k_own, g_own, gm, mk, -1.0, FAST_EXP).to(DOT_T))
        out_rows = rows.to(tl.int64)[:, None] * (H * BT) + h * BT + r[None, :]  # column block 0 of the band
        if WRITE_KB:
            if FACTORS:
                eg = e_own * exp_f32(gm, FAST_EXP)[None, :]  # exp(G) <= 1
            else:
                eg = exp_f32(g_own, FAST_EXP)
            own = rows.to(tl.int64)[:, None] * sk + h * K + cols[None, :]
            tl.store(kb_ptr + own, (k_own.to(tl.float32) * eg * b[:, None]).to(kb_ptr.dtype.element_ty), mask=mk)
            if RAW_QK:  # chunk_prep's QG and KD for these rows
                tl.store(qg_ptr + own, (q_own * eg).to(qg_ptr.dtype.element_ty), mask=mk)
                if FACTORS:  # exp(G_last - G) = exp(G_last - G_m) / E <= 1
                    g_last = tl.load(ref_base + 4 * K + cols)
                    kd = k_own * inv_own * exp_f32(g_last - gm, FAST_EXP)[None, :]
                else:
                    g_last = tl.load(g_ptr + (eos - 1).to(tl.int64) * sk + cols)  # G at the chunk's last row
                    kd = k_own * exp_f32(tl.where(mk, g_last[None, :] - g_own, 0.0), FAST_EXP)  # <= 1
                tl.store(kd_ptr + own, kd.to(kd_ptr.dtype.element_ty), mask=mk)
        akk, aqk = pair_products(kp, qp, kn, b, True, PREC)
        if INVERT_DIAG:  # chunk_solve's DIAG_INVERTED: the diagonal block holds T_II = (I + A_II)^-1
            akk = invert_diagonal_block(akk, BC, INVERT_PRODUCTS)
        t_ii = akk.to(DOT_T)  # (NEG_L) T_II as the left operand of the blocks below the diagonal
        store_band_block(a_ptr, aqk_ptr, out_rows, blk, akk, aqk, m)
        for j in range(0, blk):  # earlier sub-blocks: k_j decayed to this block's reference (factor <= 1)
            k_j, m_j = _qk_rows(k_ptr, t0 + j * BC, eos, sk_in, 1.0, K, BC, RAW_QK, QK_NORM)
            if FACTORS:  # exp(G_m - G_j) = exp(G_m - G_mJ) / E_j
                e_j, inv_j = _factor_rows(g_ptr, t0 + j * BC, eos, sk, K, BC)  # (e_j unused)
                between = exp_f32(gm - tl.load(ref_base + j * K + cols), FAST_EXP)  # [K] <= 1
                kn = tl.trans((k_j * inv_j * between[None, :]).to(DOT_T))  # [K, BC]
            else:
                g_j, _ = _load_rows(g_ptr, t0 + j * BC, eos, sk, K, BC)
                kn = tl.trans(_decay(k_j, g_j, gm, m_j, -1.0, FAST_EXP).to(DOT_T))  # [K, BC]
            akk, aqk = pair_products(kp, qp, kn, b, False, PREC)
            if NEG_L:  # the walk's HORNER operand -L_IJ = -T_II A_IJ (T_II, A_IJ in DOT_T, fp32 accumulation)
                akk = -tl.dot(t_ii, akk.to(DOT_T), input_precision=PREC)
            store_band_block(a_ptr, aqk_ptr, out_rows, j, akk, aqk, m)
        zero_band_above(a_ptr, aqk_ptr, out_rows, blk, m)
