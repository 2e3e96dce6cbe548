"""Phases 1 and 2 of the chunked KDA prefill in one launch: one program per (chunk, head) walks the K channels in
``BK``-column slices (``prefill.SLICED_PREP_INTRA``).

It writes what chunk_prep (``GATE_ONLY``) and chunk_intra (``RAW_QK``, ``INVERT_DIAG``, ``WRITE_KB``) write together,
from the same formulas, but G never goes through memory: per slice the program gates its [64, BK] block of f, takes
the in-chunk cumsum in registers (a column slice's cumsum needs no other column) and accumulates every 16 x 16 pair
block of A and Aqk over the slice. With the chunk's four 16-row sub-blocks I = 0..3, reference row m_I (row 7 of
I, or its last valid row), k' = rk k and q' = rq q (rk = 1 / ||k||, rq = scale / ||q|| from a first pass over the
full rows, or 1 and scale without the L2 norm)::

    A_IJ   += (k'_I exp(G_I - G_mI)) (k'_J exp(G_mI - G_J))^T      J <= I, per slice (then times b_I, strictly
    Aqk_IJ += (q'_I exp(G_I - G_mI)) (k'_J exp(G_mI - G_J))^T      lower / lower on J = I)
    KB = b exp(G) k',  QG = q' exp(G),  KD = k' exp(G_last - G),  GL = exp(G_last)      per slice
    T_II = (I + A_II)^-1 on A's diagonal blocks (chunk_solve.invert_diagonal_block)

The sub-block factors are chunk_intra's (see there for their range): for J < I, G_mI <= G_J so the column factor is
<= 1; inside a sub-block both stay within 8 steps of decay. Why one program per chunk: chunk_prep_intra (session 17)
gave each of a chunk's four sub-block programs the gate and cumsum over all rows before it and lost 2x; here each
element is gated once, read once from HBM (q and k a second time, from L2, after the norm pass), and G's fp32 round
trip (8 bytes per element) is gone. Bytes per token and head at K = 128 in bf16: ~1.8 KB (f, q, k in; KB, QG, KD,
the A and Aqk bands, b, GL out) against ~2.8 KB for the two launches.

Outputs as the two launches': b fp32 [T, H], GL fp32 [NC, H, K], KB, QG, KD [T, H, K] and Aqk [T, H, 64] in their
buffers' dtypes, the A band [T, H, 64] (T_II on the diagonal blocks, zeros above them) in a_ptr's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_intra import _decay, _keep_lower, store_band_block
from rocm_k3.triton_kernels.kda.chunk_solve import invert_diagonal_block
from rocm_k3.triton_kernels.kda.common import gate, sigmoid_f32


@triton.jit
def _rows(ptr, row0, eos, stride, col0, BK: tl.constexpr):
    """[16, BK] block (rows row0 .. row0 + 15, columns col0 .. col0 + BK - 1) as stored, rows past eos 0; and the
    row mask [16]."""
    rows = row0 + tl.arange(0, 16)
    m = rows < eos
    offs = rows.to(tl.int64)[:, None] * stride + col0 + tl.arange(0, BK)[None, :]
    return tl.load(ptr + offs, mask=m[:, None], other=0.0), m


@triton.jit
def _row_factor(ptr, row0, eos, stride, col0, fscale, K: tl.constexpr, BK: tl.constexpr, QK_NORM: tl.constexpr):
    """[16] factors fscale / sqrt(sum x^2 + 1e-6) of the full rows (fscale alone without QK_NORM)."""
    if QK_NORM:
        sq = tl.zeros([16], dtype=tl.float32)
        for j in range(0, K // BK):
            x, _ = _rows(ptr, row0, eos, stride, col0 + j * BK, BK)
            x = x.to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        return fscale / tl.sqrt(sq + 1e-6)
    return tl.full([16], 1.0, tl.float32) * fscale


@triton.jit
def _gated(f_ptr, row0, eos, sk, col0, a_log, dt_bias, lower_bound, HAS_GATE: tl.constexpr, SAFE_GATE: tl.constexpr,
           BK: tl.constexpr):
    """[16, BK] log-decay g (fp32) of one sub-block's slice (the gate applied to f, or f itself), rows past eos 0."""
    f, m = _rows(f_ptr, row0, eos, sk, col0, BK)
    g = f.to(tl.float32)
    if HAS_GATE:
        g = gate(g, a_log, dt_bias[None, :], lower_bound, SAFE_GATE)
    return tl.where(m[:, None], g, 0.0)


@triton.jit
def _beta(beta_ptr, b_ptr, row0, eos, h, H: tl.constexpr, BETA_LOGITS: tl.constexpr):
    """b [16] of one sub-block's rows (sigmoid of the logits, or beta as given), written to b_ptr; rows past eos 0."""
    rows = row0 + tl.arange(0, 16)
    m = rows < eos
    offs = rows.to(tl.int64) * H + h
    b = tl.load(beta_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if BETA_LOGITS:
        b = tl.where(m, sigmoid_f32(b), 0.0)
    tl.store(b_ptr + offs, b, mask=m)
    return b


@triton.jit
def _ref_row(G, row0, eos):
    """[BK] row m of one sub-block's G [16, BK]: its row 7, or its last valid row when the chunk ends before (row 0
    of a sub-block past the end, whose padding rows hold G_last: its unused pair blocks then stay finite)."""
    r = tl.arange(0, 16)
    ref = tl.maximum(tl.minimum(7, eos - 1 - row0), 0)
    return tl.sum(tl.where((r == ref)[:, None], G, 0.0), axis=0)


@triton.jit
def _pair(kp, qp, k_j, G_j, gm, m_j, a, aqk, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """(a + kp kn, aqk + qp kn) with the column operand kn = (k'_J exp(G_m - G_J))^T [BK, 16]."""
    kn = tl.trans(_decay(k_j, G_j, gm, m_j[:, None], -1.0).to(DOT_T))
    return a + tl.dot(kp, kn, input_precision=PREC), aqk + tl.dot(qp, kn, input_precision=PREC)


@triton.jit
def _row_outputs(kb_ptr, qg_ptr, kd_ptr, row0, sk, col0, k, q, G, gl, b, m, BK: tl.constexpr):
    """KB = b exp(G) k', QG = q' exp(G), KD = k' exp(G_last - G) of one sub-block's slice (rows with m)."""
    offs = (row0 + tl.arange(0, 16)).to(tl.int64)[:, None] * sk + col0 + tl.arange(0, BK)[None, :]
    eg = tl.exp(G)  # <= 1
    mm = m[:, None]
    tl.store(kb_ptr + offs, (k * eg * b[:, None]).to(kb_ptr.dtype.element_ty), mask=mm)
    tl.store(qg_ptr + offs, (q * eg).to(qg_ptr.dtype.element_ty), mask=mm)
    kd = k * tl.exp(tl.where(mm, gl[None, :] - G, 0.0))  # <= 1
    tl.store(kd_ptr + offs, kd.to(kd_ptr.dtype.element_ty), mask=mm)


@triton.jit
def _store_row_block(a_ptr, aqk_ptr, row0, eos, h, I: tl.constexpr, b, a0, q0, a1, q1, a2, q2, a3, q3,
                     H: tl.constexpr, INVERT_PRODUCTS: tl.constexpr):
    """Sub-block I's rows of the A and Aqk bands from its accumulated blocks (aJ, qJ for J <= I; the others unread):
    A_IJ times b for J < I, T_II = (I + b A_II strictly lower)^-1, Aqk lower on J = I, zeros above."""
    BT: tl.constexpr = 64
    r = tl.arange(0, 16)
    rows = row0 + r
    m = rows < eos
    out_rows = rows.to(tl.int64)[:, None] * (H * BT) + h * BT + r[None, :]
    zero = tl.zeros([16, 16], dtype=tl.float32)
    bb = b[:, None]
    if I == 0:
        dg, dq = _keep_lower(a0 * bb, q0)
    elif I == 1:
        dg, dq = _keep_lower(a1 * bb, q1)
    elif I == 2:
        dg, dq = _keep_lower(a2 * bb, q2)
    else:
        dg, dq = _keep_lower(a3 * bb, q3)
    store_band_block(a_ptr, aqk_ptr, out_rows, I, invert_diagonal_block(dg, 16, INVERT_PRODUCTS), dq, m)
    if I > 0:
        store_band_block(a_ptr, aqk_ptr, out_rows, 0, a0 * bb, q0, m)
    if I > 1:
        store_band_block(a_ptr, aqk_ptr, out_rows, 1, a1 * bb, q1, m)
    if I > 2:
        store_band_block(a_ptr, aqk_ptr, out_rows, 2, a2 * bb, q2, m)
    for j in range(I + 1, 4):
        store_band_block(a_ptr, aqk_ptr, out_rows, j, zero, zero, m)


@triton.jit
def chunk_sliced_kernel(
    q_ptr, k_ptr, f_ptr, beta_ptr,  # raw q, k [T, H, K] at row strides stride_q / stride_k; f [T, H, K]; beta [T, H]
    a_log_ptr, dt_bias_ptr,  # gate parameters fp32 [H], [H*K] (read only when HAS_GATE)
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan (int32)
    b_ptr, glast_ptr, a_ptr, aqk_ptr, kb_ptr, qg_ptr, kd_ptr,  # outputs (module docstring)
    scale, lower_bound, stride_q, stride_k,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
    HAS_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, QK_NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    INVERT_PRODUCTS: tl.constexpr,
):
    """Grid (NC, H)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    eos = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1), t0 + 64)  # end of this chunk
    sk = H * K
    r0, r1, r2, r3 = t0, t0 + 16, t0 + 32, t0 + 48  # first rows of the four sub-blocks
    qh, kh, fh = q_ptr + h * K, k_ptr + h * K, f_ptr + h * K
    # b = sigmoid(beta) (or beta), per sub-block [16]; written for the walk
    b0 = _beta(beta_ptr, b_ptr, r0, eos, h, H, BETA_LOGITS)
    b1 = _beta(beta_ptr, b_ptr, r1, eos, h, H, BETA_LOGITS)
    b2 = _beta(beta_ptr, b_ptr, r2, eos, h, H, BETA_LOGITS)
    b3 = _beta(beta_ptr, b_ptr, r3, eos, h, H, BETA_LOGITS)
    # pass 1: the row factors of q' and k' from the full rows
    rk0 = _row_factor(kh, r0, eos, stride_k, 0, 1.0, K, BK, QK_NORM)
    rk1 = _row_factor(kh, r1, eos, stride_k, 0, 1.0, K, BK, QK_NORM)
    rk2 = _row_factor(kh, r2, eos, stride_k, 0, 1.0, K, BK, QK_NORM)
    rk3 = _row_factor(kh, r3, eos, stride_k, 0, 1.0, K, BK, QK_NORM)
    rq0 = _row_factor(qh, r0, eos, stride_q, 0, scale, K, BK, QK_NORM)
    rq1 = _row_factor(qh, r1, eos, stride_q, 0, scale, K, BK, QK_NORM)
    rq2 = _row_factor(qh, r2, eos, stride_q, 0, scale, K, BK, QK_NORM)
    rq3 = _row_factor(qh, r3, eos, stride_q, 0, scale, K, BK, QK_NORM)

    zero = tl.zeros([16, 16], dtype=tl.float32)
    a00, a10, a11, a20, a21, a22, a30, a31, a32, a33 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero
    q00, q10, q11, q20, q21, q22, q30, q31, q32, q33 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero
    a_log = 0.0
    if HAS_GATE:
        a_log = tl.load(a_log_ptr + h)
    for j in range(0, K // BK):  # pass 2, one column slice per iteration
        col0 = j * BK
        dt_bias = tl.zeros([BK], dtype=tl.float32)
        if HAS_GATE:
            dt_bias = tl.load(dt_bias_ptr + h * K + col0 + tl.arange(0, BK))
        # G per sub-block: its own cumsum plus the sum of the earlier sub-blocks' g
        g0 = _gated(fh, r0, eos, sk, col0, a_log, dt_bias, lower_bound, HAS_GATE, SAFE_GATE, BK)
        g1 = _gated(fh, r1, eos, sk, col0, a_log, dt_bias, lower_bound, HAS_GATE, SAFE_GATE, BK)
        g2 = _gated(fh, r2, eos, sk, col0, a_log, dt_bias, lower_bound, HAS_GATE, SAFE_GATE, BK)
        g3 = _gated(fh, r3, eos, sk, col0, a_log, dt_bias, lower_bound, HAS_GATE, SAFE_GATE, BK)
        s0 = tl.sum(g0, axis=0)
        s1 = s0 + tl.sum(g1, axis=0)
        s2 = s1 + tl.sum(g2, axis=0)
        gl = s2 + tl.sum(g3, axis=0)  # G at the chunk's last row (rows past eos add 0)
        G0 = tl.cumsum(g0, axis=0)
        G1 = tl.cumsum(g1, axis=0) + s0[None, :]
        G2 = tl.cumsum(g2, axis=0) + s1[None, :]
        G3 = tl.cumsum(g3, axis=0) + s2[None, :]
        tl.store(glast_ptr + (c * H + h).to(tl.int64) * K + col0 + tl.arange(0, BK), tl.exp(gl))
        k0, m0 = _rows(kh, r0, eos, stride_k, col0, BK)
        k1, m1 = _rows(kh, r1, eos, stride_k, col0, BK)
        k2, m2 = _rows(kh, r2, eos, stride_k, col0, BK)
        k3, m3 = _rows(kh, r3, eos, stride_k, col0, BK)
        k0, k1, k2, k3 = (k0.to(tl.float32) * rk0[:, None], k1.to(tl.float32) * rk1[:, None],
                          k2.to(tl.float32) * rk2[:, None], k3.to(tl.float32) * rk3[:, None])
        q0, _ = _rows(qh, r0, eos, stride_q, col0, BK)
        q1, _ = _rows(qh, r1, eos, stride_q, col0, BK)
        q2, _ = _rows(qh, r2, eos, stride_q, col0, BK)
        q3, _ = _rows(qh, r3, eos, stride_q, col0, BK)
        q0, q1, q2, q3 = (q0.to(tl.float32) * rq0[:, None], q1.to(tl.float32) * rq1[:, None],
                          q2.to(tl.float32) * rq2[:, None], q3.to(tl.float32) * rq3[:, None])
        _row_outputs(kb_ptr, qg_ptr, kd_ptr, r0, sk, h * K + col0, k0, q0, G0, gl, b0, m0, BK)
        _row_outputs(kb_ptr, qg_ptr, kd_ptr, r1, sk, h * K + col0, k1, q1, G1, gl, b1, m1, BK)
        _row_outputs(kb_ptr, qg_ptr, kd_ptr, r2, sk, h * K + col0, k2, q2, G2, gl, b2, m2, BK)
        _row_outputs(kb_ptr, qg_ptr, kd_ptr, r3, sk, h * K + col0, k3, q3, G3, gl, b3, m3, BK)
        # the pair blocks of this slice, row sub-block by row sub-block (each with its own reference row)
        gm = _ref_row(G0, r0, eos)
        kp = _decay(k0, G0, gm, m0[:, None], 1.0).to(DOT_T)
        qp = _decay(q0, G0, gm, m0[:, None], 1.0).to(DOT_T)
        a00, q00 = _pair(kp, qp, k0, G0, gm, m0, a00, q00, DOT_T, PREC)
        gm = _ref_row(G1, r1, eos)
        kp = _decay(k1, G1, gm, m1[:, None], 1.0).to(DOT_T)
        qp = _decay(q1, G1, gm, m1[:, None], 1.0).to(DOT_T)
        a10, q10 = _pair(kp, qp, k0, G0, gm, m0, a10, q10, DOT_T, PREC)
        a11, q11 = _pair(kp, qp, k1, G1, gm, m1, a11, q11, DOT_T, PREC)
        gm = _ref_row(G2, r2, eos)
        kp = _decay(k2, G2, gm, m2[:, None], 1.0).to(DOT_T)
        qp = _decay(q2, G2, gm, m2[:, None], 1.0).to(DOT_T)
        a20, q20 = _pair(kp, qp, k0, G0, gm, m0, a20, q20, DOT_T, PREC)
        a21, q21 = _pair(kp, qp, k1, G1, gm, m1, a21, q21, DOT_T, PREC)
        a22, q22 = _pair(kp, qp, k2, G2, gm, m2, a22, q22, DOT_T, PREC)
        gm = _ref_row(G3, r3, eos)
        kp = _decay(k3, G3, gm, m3[:, None], 1.0).to(DOT_T)
        qp = _decay(q3, G3, gm, m3[:, None], 1.0).to(DOT_T)
        a30, q30 = _pair(kp, qp, k0, G0, gm, m0, a30, q30, DOT_T, PREC)
        a31, q31 = _pair(kp, qp, k1, G1, gm, m1, a31, q31, DOT_T, PREC)
        a32, q32 = _pair(kp, qp, k2, G2, gm, m2, a32, q32, DOT_T, PREC)
        a33, q33 = _pair(kp, qp, k3, G3, gm, m3, a33, q33, DOT_T, PREC)

    _store_row_block(a_ptr, aqk_ptr, r0, eos, h, 0, b0, a00, q00, zero, zero, zero, zero, zero, zero, H,
                     INVERT_PRODUCTS)
    if r1 < eos:
        _store_row_block(a_ptr, aqk_ptr, r1, eos, h, 1, b1, a10, q10, a11, q11, zero, zero, zero, zero, H,
                         INVERT_PRODUCTS)
    if r2 < eos:
        _store_row_block(a_ptr, aqk_ptr, r2, eos, h, 2, b2, a20, q20, a21, q21, a22, q22, zero, zero, H,
                         INVERT_PRODUCTS)
    if r3 < eos:
        _store_row_block(a_ptr, aqk_ptr, r3, eos, h, 3, b3, a30, q30, a31, q31, a32, q32, a33, q33, H,
                         INVERT_PRODUCTS)
