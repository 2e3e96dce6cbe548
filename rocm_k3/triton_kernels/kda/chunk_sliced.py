"""Phases 1 and 2 of the chunked KDA prefill in one launch: one program per (chunk, head) walks the K channels in
``BK``-column slices (``prefill.SLICED_PREP_INTRA``).

It writes what chunk_prep (``GATE_ONLY``) and chunk_intra (``RAW_QK``, ``INVERT_DIAG``, ``WRITE_KB``) write together,
from the same formulas (G_last for KD is the slice's sum of g, as GL's, where chunk_intra reads the cumsum's last
row: a few ulps apart), but G never goes through memory: per slice the program gates its [64, BK] tile of f, takes
the in-chunk cumsum in registers (a column slice's cumsum needs no other column) and accumulates the pair products
over the slice. With the chunk's four 16-row sub-blocks I = 0..3, reference row m_I (row 7 of I, or its last valid
row), k' = rk k and q' = rq q (rk = 1 / ||k||, rq = scale / ||q|| from a first pass over the full rows, or 1 and
scale without the L2 norm), per slice::

    A_I   += (k'_I exp(G_I - G_mI)) (k' exp(G_mI - G))^T_{rows <= end of I}      [16, 64] per sub-block I
    Aqk_I += (q'_I exp(G_I - G_mI)) (k' exp(G_mI - G))^T_{rows <= end of I}
    KB = b exp(G) k',  QG = q' exp(G),  KD = k' exp(G_last - G),  GL = exp(G_last)      [64, BK] tiles

then per sub-block A_I times b (strictly lower), T_II = (I + A_II)^-1 on its diagonal block
(chunk_solve.invert_diagonal_block), Aqk lower, zeros above. The decay factors are chunk_intra's sub-block
factors (see there for their range): for the earlier rows G_mI <= G_j, so the column factor is <= 1; rows after
sub-block I get zero operands (their factor could overflow; those columns are above the diagonal). The
accumulators are four [16, 64] bands per matrix (at 4 warps each warp owns a 16-column MMA tile; sixteen [16, 16]
blocks would be replicated on every warp and spill).

Why one program per chunk: chunk_prep_intra (session 17) gave each of a chunk's four sub-block programs the gate and
cumsum over all the rows before it and lost 2x; here each element is gated once, read once from HBM (q and k a
second time, from L1 / L2, after the norm pass), and G's fp32 round trip (8 bytes per element) is gone. Bytes per
token and head at K = 128 in bf16: ~1.8 KB (f, q, k in; KB, QG, KD, the A and Aqk bands, b, GL out) against ~2.8 KB
for the two launches. The price: the MMA also runs on the zero columns past sub-block I (6 of 16 blocks).

Outputs as the two launches': b fp32 [T, H], GL fp32 [NC, H, K], KB, QG, KD [T, H, K] and Aqk [T, H, 64] in their
buffers' dtypes, the A band [T, H, 64] (T_II on the diagonal blocks, zeros above them) in a_ptr's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_intra import _load_rows
from rocm_k3.triton_kernels.kda.chunk_solve import invert_diagonal_block
from rocm_k3.triton_kernels.kda.common import gate, sigmoid_f32


@triton.jit
def _row_factor(ptr, t0, eos, stride, fscale, K: tl.constexpr, BK: tl.constexpr, QK_NORM: tl.constexpr):
    """[64] factors fscale / sqrt(sum x^2 + 1e-6) of the chunk's full rows (fscale alone without QK_NORM)."""
    if QK_NORM:
        sq = tl.zeros([64], dtype=tl.float32)
        for j in range(0, K // BK):
            x, _ = _load_rows(ptr + j * BK, t0, eos, stride, BK, 64)
            x = x.to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        return fscale / tl.sqrt(sq + 1e-6)
    return tl.full([64], 1.0, tl.float32) * fscale


@triton.jit
def _beta_rows(beta_ptr, row0, eos, h, R: tl.constexpr, H: tl.constexpr, BETA_LOGITS: tl.constexpr):
    """(b [R] of rows row0 .. row0 + R - 1: sigmoid of the logits, or beta as given, rows past eos 0; their offsets
    in a [T, H] tensor; the row mask)."""
    rows = row0 + tl.arange(0, R)
    m = rows < eos
    offs = rows.to(tl.int64) * H + h
    b = tl.load(beta_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if BETA_LOGITS:
        b = tl.where(m, sigmoid_f32(b), 0.0)
    return b, offs, m


@triton.jit
def _pick(x4, I: tl.constexpr):
    """Block I [16, BK] of x4 [4, 16, BK] (a [64, BK] chunk tile reshaped), exactly."""
    s = tl.arange(0, 4)[:, None, None]
    return tl.sum(tl.where(s == I, x4, 0.0), axis=0)


@triton.jit
def _ref_row(G, row0, eos):
    """[BK] row m of one sub-block's G [16, BK]: its row 7, or its last valid row when the chunk ends before (row 0
    of a sub-block past the end, whose padding rows hold G_last: its unused blocks then stay finite)."""
    r = tl.arange(0, 16)
    ref = tl.maximum(tl.minimum(7, eos - 1 - row0), 0)
    return tl.sum(tl.where((r == ref)[:, None], G, 0.0), axis=0)


@triton.jit
def _row_block_products(G4, k4, q4, G, k, keep_all, t0, eos, I: tl.constexpr, a, aqk, DOT_T: tl.constexpr,
                        PREC: tl.constexpr):
    """(a + kp kn_I, aqk + qp kn_I) [16, 64] for sub-block I and one column slice: row operands k'_I exp(G_I - G_mI),
    q'_I exp(G_I - G_mI) [16, BK] and the column operand kn_I = (k' exp(G_mI - G))^T [BK, 64] over the chunk's rows
    up to the end of sub-block I (later rows, whose factor could overflow, 0)."""
    row0 = t0 + I * 16
    G_i = _pick(G4, I)
    m_i = (row0 + tl.arange(0, 16)) < eos
    gm = _ref_row(G_i, row0, eos)
    e = tl.exp(tl.where(m_i[:, None], G_i - gm[None, :], 0.0))
    kp = (_pick(k4, I) * e).to(DOT_T)
    qp = (_pick(q4, I) * e).to(DOT_T)
    keep = (keep_all & (tl.arange(0, 64) < (I + 1) * 16))[:, None]
    kn = tl.trans((k * tl.where(keep, tl.exp(tl.where(keep, gm[None, :] - G, 0.0)), 0.0)).to(DOT_T))
    return a + tl.dot(kp, kn, input_precision=PREC), aqk + tl.dot(qp, kn, input_precision=PREC)


@triton.jit
def _block(x, J: tl.constexpr):
    """Columns 16 J .. 16 J + 15 of x [16, 64], exactly: [16, 16]."""
    s = tl.arange(0, 4)[None, :, None]
    return tl.sum(tl.where(s == J, tl.reshape(x, [16, 4, 16]), 0.0), axis=1)


@triton.jit
def _inverse_rows(a, I: tl.constexpr, r0, r1, r2, beta_ptr, t0, eos, h, H: tl.constexpr, BETA_LOGITS: tl.constexpr,
                  INVERT_PRODUCTS: tl.constexpr):
    """Rows 16 I .. 16 I + 15 of (I + A)^-1 [16, 64] (FULL_INVERSE) from sub-block I's accumulated rows ``a`` (before
    b) and the rows r0 .. r2 of the sub-blocks before it: R_I = T_II (E_I - sum_{J<I} A_IJ R_J), T_II = (I +
    A_II)^-1, in fp32 ("ieee" dots); rows past eos hold identity rows and are not stored."""
    b, _, _ = _beta_rows(beta_ptr, t0 + I * 16, eos, h, 16, H, BETA_LOGITS)
    a = a * b[:, None]
    r = tl.arange(0, 16)
    diag = tl.where(r[:, None] > r[None, :], _block(a, I), 0.0)
    rhs = tl.where(tl.arange(0, 64)[None, :] == (I * 16 + r)[:, None], 1.0, 0.0)  # E_I [16, 64]
    if I > 0:
        rhs -= tl.dot(_block(a, 0), r0, input_precision="ieee")
    if I > 1:
        rhs -= tl.dot(_block(a, 1), r1, input_precision="ieee")
    if I > 2:
        rhs -= tl.dot(_block(a, 2), r2, input_precision="ieee")
    return tl.dot(invert_diagonal_block(diag, 16, INVERT_PRODUCTS), rhs, input_precision="ieee")


@triton.jit
def _store_rows(ptr, t0, eos, h, I: tl.constexpr, x, H: tl.constexpr):
    """Sub-block I's rows [16, 64] of a [T, H, 64] band (rows past eos not stored)."""
    r = tl.arange(0, 16)
    rows = (t0 + I * 16 + r).to(tl.int64)[:, None] * (H * 64) + h * 64
    tl.store(ptr + rows + tl.arange(0, 64)[None, :], x.to(ptr.dtype.element_ty), mask=(t0 + I * 16 + r < eos)[:, None])


@triton.jit
def _store_aqk_rows(aqk_ptr, t0, eos, h, I: tl.constexpr, aqk, H: tl.constexpr):
    """Sub-block I's rows of the Aqk band: columns j <= i, zeros above."""
    r = tl.arange(0, 16)
    keep = tl.arange(0, 64)[None, :] <= (I * 16 + r)[:, None]
    _store_rows(aqk_ptr, t0, eos, h, I, tl.where(keep, aqk, 0.0), H)


@triton.jit
def _store_row_block(a_ptr, aqk_ptr, beta_ptr, t0, eos, h, I: tl.constexpr, a, aqk, H: tl.constexpr,
                     BETA_LOGITS: tl.constexpr, INVERT_PRODUCTS: tl.constexpr):
    """Sub-block I's rows of the A and Aqk bands from its accumulated [16, 64] rows: A times b left of the diagonal
    block, T_II = (I + b A_II strictly lower)^-1 on it, zeros right of it; Aqk for columns j <= i, zeros above."""
    row0 = t0 + I * 16
    # b re-read (from L1) rather than kept live through the slice loop: that costs 22 sm_90 registers (168 -> 190)
    b, _, m = _beta_rows(beta_ptr, row0, eos, h, 16, H, BETA_LOGITS)
    r = tl.arange(0, 16)
    j = tl.arange(0, 64)
    rows = (row0 + r).to(tl.int64)[:, None] * (H * 64) + h * 64
    a = a * b[:, None]
    off_diag = (j // 16 != I)[None, :]
    tl.store(a_ptr + rows + j[None, :], tl.where(j[None, :] < I * 16, a, 0.0).to(a_ptr.dtype.element_ty),
             mask=m[:, None] & off_diag)
    _store_aqk_rows(aqk_ptr, t0, eos, h, I, aqk, H)
    diag = tl.where(r[:, None] > r[None, :], _block(a, I), 0.0)  # [16, 16] columns 16 I ..
    t = invert_diagonal_block(diag, 16, INVERT_PRODUCTS)
    tl.store(a_ptr + rows + I * 16 + r[None, :], t.to(a_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def chunk_sliced_kernel(
    q_ptr, k_ptr, f_ptr, beta_ptr,  # raw q, k [T, H, K] at row strides stride_q / stride_k; f [T, H, K]; beta [T, H]
    a_log_ptr, dt_bias_ptr,  # gate parameters fp32 [H], [H*K] (read only when HAS_GATE)
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan (int32)
    b_ptr, glast_ptr, a_ptr, aqk_ptr, kb_ptr, qg_ptr, kd_ptr,  # outputs (module docstring)
    scale, lower_bound, stride_q, stride_k,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
    HAS_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, QK_NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    INVERT_PRODUCTS: tl.constexpr, FULL_INVERSE: tl.constexpr = False,
):
    """Grid (NC, H). The pair blocks accumulate as four [16, 64] row bands per matrix (sub-block I's rows against
    all 64 columns; the columns past sub-block I get zero operands), so the accumulators use every warp's MMA tile
    instead of sixteen replicated [16, 16] ones."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    eos = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1), t0 + 64)  # end of this chunk
    sk = H * K
    qh, kh, fh = q_ptr + h * K, k_ptr + h * K, f_ptr + h * K
    b, b_offs, m = _beta_rows(beta_ptr, t0, eos, h, 64, H, BETA_LOGITS)  # [64]
    tl.store(b_ptr + b_offs, b, mask=m)
    rk = _row_factor(kh, t0, eos, stride_k, 1.0, K, BK, QK_NORM)  # pass 1: k' = rk k, q' = rq q
    rq = _row_factor(qh, t0, eos, stride_q, scale, K, BK, QK_NORM)
    rows = (t0 + tl.arange(0, 64)).to(tl.int64)[:, None] * sk + h * K + tl.arange(0, BK)[None, :]
    mm = m[:, None]
    zero = tl.zeros([16, 64], dtype=tl.float32)
    a0, a1, a2, a3, q0, q1, q2, q3 = zero, zero, zero, zero, zero, zero, zero, zero
    a_log = 0.0
    if HAS_GATE:
        a_log = tl.load(a_log_ptr + h)
    for j in range(0, K // BK):  # pass 2, one column slice per iteration
        col0 = j * BK
        f, _ = _load_rows(fh + col0, t0, eos, sk, BK, 64)
        g = f.to(tl.float32)
        if HAS_GATE:
            dt_bias = tl.load(dt_bias_ptr + h * K + col0 + tl.arange(0, BK))
            g = gate(g, a_log, dt_bias[None, :], lower_bound, SAFE_GATE)
        g = tl.where(mm, g, 0.0)
        G = tl.cumsum(g, axis=0)  # [64, BK]
        gl = tl.sum(g, axis=0)  # G at the chunk's last row (rows past eos add 0)
        tl.store(glast_ptr + (c * H + h).to(tl.int64) * K + col0 + tl.arange(0, BK), tl.exp(gl))
        k, _ = _load_rows(kh + col0, t0, eos, stride_k, BK, 64)
        q, _ = _load_rows(qh + col0, t0, eos, stride_q, BK, 64)
        k = k.to(tl.float32) * rk[:, None]
        q = q.to(tl.float32) * rq[:, None]
        eg = tl.exp(G)  # <= 1
        tl.store(kb_ptr + rows + col0, (k * eg * b[:, None]).to(kb_ptr.dtype.element_ty), mask=mm)
        tl.store(qg_ptr + rows + col0, (q * eg).to(qg_ptr.dtype.element_ty), mask=mm)
        kd = k * tl.exp(tl.where(mm, gl[None, :] - G, 0.0))  # <= 1
        tl.store(kd_ptr + rows + col0, kd.to(kd_ptr.dtype.element_ty), mask=mm)
        G4 = tl.reshape(G, [4, 16, BK])
        k4 = tl.reshape(k, [4, 16, BK])
        q4 = tl.reshape(q, [4, 16, BK])
        a0, q0 = _row_block_products(G4, k4, q4, G, k, m, t0, eos, 0, a0, q0, DOT_T, PREC)
        a1, q1 = _row_block_products(G4, k4, q4, G, k, m, t0, eos, 1, a1, q1, DOT_T, PREC)
        a2, q2 = _row_block_products(G4, k4, q4, G, k, m, t0, eos, 2, a2, q2, DOT_T, PREC)
        a3, q3 = _row_block_products(G4, k4, q4, G, k, m, t0, eos, 3, a3, q3, DOT_T, PREC)

    if FULL_INVERSE:  # the A band holds (I + A)^-1 whole; the Aqk rows first (their accumulators die there)
        _store_aqk_rows(aqk_ptr, t0, eos, h, 0, q0, H)
        _store_aqk_rows(aqk_ptr, t0, eos, h, 1, q1, H)
        _store_aqk_rows(aqk_ptr, t0, eos, h, 2, q2, H)
        _store_aqk_rows(aqk_ptr, t0, eos, h, 3, q3, H)
        r0 = _inverse_rows(a0, 0, a0, a0, a0, beta_ptr, t0, eos, h, H, BETA_LOGITS, INVERT_PRODUCTS)
        _store_rows(a_ptr, t0, eos, h, 0, r0, H)
        r1 = _inverse_rows(a1, 1, r0, r0, r0, beta_ptr, t0, eos, h, H, BETA_LOGITS, INVERT_PRODUCTS)
        _store_rows(a_ptr, t0, eos, h, 1, r1, H)
        r2 = _inverse_rows(a2, 2, r0, r1, r1, beta_ptr, t0, eos, h, H, BETA_LOGITS, INVERT_PRODUCTS)
        _store_rows(a_ptr, t0, eos, h, 2, r2, H)
        r3 = _inverse_rows(a3, 3, r0, r1, r2, beta_ptr, t0, eos, h, H, BETA_LOGITS, INVERT_PRODUCTS)
        _store_rows(a_ptr, t0, eos, h, 3, r3, H)
    else:
        _store_row_block(a_ptr, aqk_ptr, beta_ptr, t0, eos, h, 0, a0, q0, H, BETA_LOGITS, INVERT_PRODUCTS)
        if t0 + 16 < eos:
            _store_row_block(a_ptr, aqk_ptr, beta_ptr, t0, eos, h, 1, a1, q1, H, BETA_LOGITS, INVERT_PRODUCTS)
        if t0 + 32 < eos:
            _store_row_block(a_ptr, aqk_ptr, beta_ptr, t0, eos, h, 2, a2, q2, H, BETA_LOGITS, INVERT_PRODUCTS)
        if t0 + 48 < eos:
            _store_row_block(a_ptr, aqk_ptr, beta_ptr, t0, eos, h, 3, a3, q3, H, BETA_LOGITS, INVERT_PRODUCTS)
