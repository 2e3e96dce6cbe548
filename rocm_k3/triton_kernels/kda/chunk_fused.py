"""Phases 1-3 of the chunked KDA prefill in one launch: prep, in-chunk A / Aqk and the WY solve, one program per
(chunk, head), walking the chunk's four 16-row sub-blocks in order with A kept on chip.

First G_last = sum of g over the chunk (a pre-pass over the gate input; GL = exp(G_last) written). Then for
sub-block I (rows 16 I .. 16 I + 15 of the chunk), with the carry c = sum of g over the earlier rows::

    g = kda_gate(f),  G_I = c + cumsum(g),  q', k', b      as in chunk_prep
    QG_I = q' exp(G_I),  KD_I = k' exp(G_last - G_I)         -> written
    X_I  = b exp(G_I) k'                                     -> written into W's rows (read back by the solve)
    m_I  = G at the block's 8th row (the reference row of chunk_intra)
    kinv_I = k' exp(m_I - G_I)                               kept (fp32 [16, K]): the column side of A
    A_IJ   = b_I (k' exp(G_I - m_I)) (kinv_J exp(m_I - m_J))^T     J <= I (J = I: strictly lower part), kept
    Aqk_IJ =     (q' exp(G_I - m_I)) (kinv_J exp(m_I - m_J))^T     J <= I (J = I: lower part), written; J > I: 0

so every decay factor is the one chunk_intra uses (within 8 steps of a reference row, or <= 1). Then the solve
of chunk_solve runs on the A blocks held in registers: the 16 x 16 diagonal blocks inverted row by row in fp32,
W_I = T_II (X_I - sum_{J<I} A_IJ W_J), the same for U with b v. Compared with the three launches this drops the
q', k', G, b and A round trips through memory (~1.3 KB written and ~2.5 KB read per token and head at K = V = 128).
Register use (sm_90 cross-compile, 4 warps): 255 per thread with ~70 B spilled, so one or two programs per SM;
not faster than the three launches when last timed (RESULTS.md, 2026-12-04), hence ``prefill.FUSED`` off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_intra import pair_products
from rocm_k3.triton_kernels.kda.chunk_solve import _mm, invert_diagonal_blocks
from rocm_k3.triton_kernels.kda.common import chunk_bounds, gate_block, sigmoid_f32


@triton.jit
def _prep_block(q_c, k_c, g_c, beta_c, a_log_ptr, dt_bias_ptr, qg_c, kd_c, w_c, carry, glast, n, scale, lower_bound,
                I: tl.constexpr, H: tl.constexpr, K: tl.constexpr, HAS_GATE: tl.constexpr,
                SAFE_GATE: tl.constexpr, QK_NORM: tl.constexpr, BETA_LOGITS: tl.constexpr, DOT_T: tl.constexpr):
    """Sub-block I: writes QG, KD and X (into W's rows); returns (kp, qp, kinv, m, b, carry after the block)."""
    BC: tl.constexpr = 16
    r = tl.arange(0, BC)
    rk = tl.arange(0, K)
    rows = I * BC + r
    mrow = rows < n
    m2d = mrow[:, None]
    loc = rows[:, None] * (H * K) + rk[None, :]  # [BC, K] from the chunk's first row (head offset in the bases)
    g = gate_block(g_c, a_log_ptr, dt_bias_ptr, n, lower_bound, I, H, K, HAS_GATE, SAFE_GATE)
    gc = carry[None, :] + tl.cumsum(g, axis=0)  # G, flat past the chunk's end
    m = tl.sum(tl.where(r[:, None] == 7, gc, 0.0), axis=0)  # [K] reference row
    b = tl.load(beta_c + rows * H, mask=mrow, other=0.0).to(tl.float32)
    if BETA_LOGITS:
        b = sigmoid_f32(b)
    b = tl.where(mrow, b, 0.0)
    k = tl.load(k_c + loc, mask=m2d, other=0.0).to(tl.float32)
    if QK_NORM:
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    eg = tl.exp(gc)
    tl.store(w_c + loc, (k * eg * b[:, None]).to(w_c.dtype.element_ty), mask=m2d)  # X_I
    tl.store(kd_c + loc, (k * tl.exp(tl.where(m2d, glast[None, :] - gc, 0.0))).to(kd_c.dtype.element_ty), mask=m2d)
    dec = tl.exp(gc - m[None, :])
    kp = (k * dec).to(DOT_T)
    kinv = k * tl.exp(m[None, :] - gc)
    q = tl.load(q_c + loc, mask=m2d, other=0.0).to(tl.float32)
    if QK_NORM:
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None]
    else:
        q = q * scale
    tl.store(qg_c + loc, (q * eg).to(qg_c.dtype.element_ty), mask=m2d)
    qp = (q * dec).to(DOT_T)
    return kp, qp, kinv, m, b, carry + tl.sum(g, axis=0)


@triton.jit
def _pair(kp, qp, b, m_i, kinv_j, m_j, aqk_c, n, I: tl.constexpr, J: tl.constexpr, H: tl.constexpr,
          DOT_T: tl.constexpr, PREC: tl.constexpr):
    """A_IJ (fp32, returned) and Aqk_IJ (written) for J <= I."""
    BC: tl.constexpr = 16
    BT: tl.constexpr = 64
    r = tl.arange(0, BC)
    if J == I:
        kn = tl.trans(kinv_j.to(DOT_T))  # [K, BC]
    else:
        kn = tl.trans((kinv_j * tl.exp(m_i - m_j)[None, :]).to(DOT_T))
    a, aqk = pair_products(kp, qp, kn, b, J == I, PREC)
    rows = I * BC + r
    tl.store(aqk_c + rows[:, None] * (H * BT) + J * BC + r[None, :], aqk.to(aqk_c.dtype.element_ty),
             mask=(rows < n)[:, None])
    return a


@triton.jit
def _solve_block(w_c, u_c, v_c, b, t, rhs_w, rhs_u, n, I: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """W_I = T_II (X_I - rhs_w), U_I = T_II (b v_I - rhs_u); writes both, returns them in the dot dtype."""
    BC: tl.constexpr = 16
    rows = I * BC + tl.arange(0, BC)
    m2d = (rows < n)[:, None]
    loc_k = rows[:, None] * (H * K) + tl.arange(0, K)[None, :]
    loc_v = rows[:, None] * (H * V) + tl.arange(0, V)[None, :]
    x = tl.load(w_c + loc_k, mask=m2d, other=0.0).to(tl.float32)
    y = tl.load(v_c + loc_v, mask=m2d, other=0.0).to(tl.float32) * b[:, None]
    w = _mm(t, x - rhs_w, DOT_T, PREC)
    u = _mm(t, y - rhs_u, DOT_T, PREC)
    tl.store(w_c + loc_k, w.to(w_c.dtype.element_ty), mask=m2d)
    tl.store(u_c + loc_v, u.to(u_c.dtype.element_ty), mask=m2d)
    return w.to(DOT_T), u.to(DOT_T)  # what the later blocks' products read (they cast to DOT_T anyway)


@triton.jit
def chunk_fused_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # inputs: q, k [T, H, K]; v [T, H, V]; g [T, H, K]; beta [T, H]
    a_log_ptr, dt_bias_ptr,  # gate parameters: fp32 [H], fp32 [H*K] (read only when HAS_GATE)
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan (int32)
    qg_ptr, kd_ptr, glast_ptr, aqk_ptr, w_ptr, u_ptr,  # outputs: QG, KD [T,H,K]; GL fp32 [NC,H,K]; Aqk [T,H,64]; W, U
    scale, lower_bound,  # fp32 scalars
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    HAS_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, QK_NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    DOT_T: tl.constexpr, PREC: tl.constexpr,
):
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = chunk_bounds(chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, c, BT)  # rows t0 .. t0 + n - 1
    row0 = t0.to(tl.int64)  # 64-bit row base; the tiles add 32-bit offsets
    bk = row0 * (H * K) + h * K
    q_c, k_c, g_c, qg_c, kd_c, w_c = q_ptr + bk, k_ptr + bk, g_ptr + bk, qg_ptr + bk, kd_ptr + bk, w_ptr + bk
    bv = row0 * (H * V) + h * V
    v_c, u_c = v_ptr + bv, u_ptr + bv
    beta_c = beta_ptr + row0 * H + h
    aqk_c = aqk_ptr + row0 * (H * BT) + h * BT
    a_log_h, dt_bias_h = a_log_ptr + h, dt_bias_ptr + h * K
    glast = tl.zeros([K], dtype=tl.float32)  # G at the chunk's last row, first (KD is written during the walk)
    for i in tl.static_range(BT // BC):
        glast += tl.sum(gate_block(g_c, a_log_h, dt_bias_h, n, lower_bound, i, H, K, HAS_GATE, SAFE_GATE), axis=0)
    tl.store(glast_ptr + (c * H + h).to(tl.int64) * K + tl.arange(0, K), tl.exp(glast))
    carry = tl.zeros([K], dtype=tl.float32)
    rt = tl.arange(0, BT)
    upper = ((rt[None, :] // BC) > (rt[:, None] // BC)) & (rt < n)[:, None]  # Aqk blocks J > I: zero
    tl.store(aqk_c + rt[:, None] * (H * BT) + rt[None, :], tl.zeros([BT, BT], dtype=aqk_c.dtype.element_ty),
             mask=upper)

    kp, qp, kinv0, m0, b0, carry = _prep_block(q_c, k_c, g_c, beta_c, a_log_h, dt_bias_h, qg_c, kd_c, w_c, carry,
                                               glast, n, scale, lower_bound, 0, H, K, HAS_GATE, SAFE_GATE, QK_NORM,
                                               BETA_LOGITS, DOT_T)
    a00 = _pair(kp, qp, b0, m0, kinv0, m0, aqk_c, n, 0, 0, H, DOT_T, PREC)

    kp, qp, kinv1, m1, b1, carry = _prep_block(q_c, k_c, g_c, beta_c, a_log_h, dt_bias_h, qg_c, kd_c, w_c, carry,
                                               glast, n, scale, lower_bound, 1, H, K, HAS_GATE, SAFE_GATE, QK_NORM,
                                               BETA_LOGITS, DOT_T)
    a10 = _pair(kp, qp, b1, m1, kinv0, m0, aqk_c, n, 1, 0, H, DOT_T, PREC)
    a11 = _pair(kp, qp, b1, m1, kinv1, m1, aqk_c, n, 1, 1, H, DOT_T, PREC)

    kp, qp, kinv2, m2, b2, carry = _prep_block(q_c, k_c, g_c, beta_c, a_log_h, dt_bias_h, qg_c, kd_c, w_c, carry,
                                               glast, n, scale, lower_bound, 2, H, K, HAS_GATE, SAFE_GATE, QK_NORM,
                                               BETA_LOGITS, DOT_T)
    a20 = _pair(kp, qp, b2, m2, kinv0, m0, aqk_c, n, 2, 0, H, DOT_T, PREC)
    a21 = _pair(kp, qp, b2, m2, kinv1, m1, aqk_c, n, 2, 1, H, DOT_T, PREC)
    a22 = _pair(kp, qp, b2, m2, kinv2, m2, aqk_c, n, 2, 2, H, DOT_T, PREC)

    kp, qp, kinv3, m3, b3, carry = _prep_block(q_c, k_c, g_c, beta_c, a_log_h, dt_bias_h, qg_c, kd_c, w_c, carry,
                                               glast, n, scale, lower_bound, 3, H, K, HAS_GATE, SAFE_GATE, QK_NORM,
                                               BETA_LOGITS, DOT_T)
    a30 = _pair(kp, qp, b3, m3, kinv0, m0, aqk_c, n, 3, 0, H, DOT_T, PREC)
    a31 = _pair(kp, qp, b3, m3, kinv1, m1, aqk_c, n, 3, 1, H, DOT_T, PREC)
    a32 = _pair(kp, qp, b3, m3, kinv2, m2, aqk_c, n, 3, 2, H, DOT_T, PREC)
    a33 = _pair(kp, qp, b3, m3, kinv3, m3, aqk_c, n, 3, 3, H, DOT_T, PREC)


    t00, t11, t22, t33 = invert_diagonal_blocks(a00, a11, a22, a33, BC)  # row by row, fp32, as in chunk_solve

    tl.debug_barrier()  # X rows written by other threads of this program are read back below
    zk = tl.zeros([BC, K], dtype=tl.float32)
    zv = tl.zeros([BC, V], dtype=tl.float32)
    w0, u0 = _solve_block(w_c, u_c, v_c, b0, t00, zk, zv, n, 0, H, K, V, DOT_T, PREC)
    w1, u1 = _solve_block(w_c, u_c, v_c, b1, t11, _mm(a10, w0, DOT_T, PREC), _mm(a10, u0, DOT_T, PREC), n, 1,
                          H, K, V, DOT_T, PREC)
    w2, u2 = _solve_block(w_c, u_c, v_c, b2, t22, _mm(a20, w0, DOT_T, PREC) + _mm(a21, w1, DOT_T, PREC),
                          _mm(a20, u0, DOT_T, PREC) + _mm(a21, u1, DOT_T, PREC), n, 2, H, K, V, DOT_T, PREC)
    _solve_block(w_c, u_c, v_c, b3, t33,
                 _mm(a30, w0, DOT_T, PREC) + _mm(a31, w1, DOT_T, PREC) + _mm(a32, w2, DOT_T, PREC),
                 _mm(a30, u0, DOT_T, PREC) + _mm(a31, u1, DOT_T, PREC) + _mm(a32, u2, DOT_T, PREC), n, 3,
                 H, K, V, DOT_T, PREC)
