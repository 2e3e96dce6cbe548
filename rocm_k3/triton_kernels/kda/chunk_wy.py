"""Phases 2 and 3 of the chunked KDA prefill in one launch (``prefill.MERGE_WY``): the in-chunk pair matrices
and the WY form, one program per (chunk, head), A kept in registers.

Inputs are chunk_prep's q', k', G (fp32) and b; for the chunk's four 16-row sub-blocks I (rows 16 I .. 16 I + 15)::

    A_IJ   = b_I (k'_I exp(G_I - m_I)) (k'_J exp(m_I - G_J))^T     J <= I (J = I: strictly lower), fp32, kept
    Aqk_IJ =     (q'_I exp(G_I - m_I)) (k'_J exp(m_I - G_J))^T     J <= I (J = I: lower), written; J > I: 0

with m_I the reference row of chunk_intra (G at the block's 8th row), so every decay factor is the one chunk_intra
uses. Then the blocks of T = (I + A)^-1, lower block triangular::

    T_II = (I + A_II)^-1                              row by row in fp32 (chunk_solve's invert_diagonal_blocks)
    T_IJ = -T_II sum_{J <= L < I} A_IL T_LJ            J < I, fp32 products (16 x 16 x 16)

and W_I = sum_{J <= I} T_IJ X_J, U_I = sum_{J <= I} T_IJ (b_J v_J) with X_J = b_J exp(G_J) k'_J re-read per
product (cache hits), so only the twenty 16 x 16 A / T blocks and one [16, K] + [16, V] accumulator pair stay live.
Same W, U as chunk_solve's block substitution up to rounding order (T_IJ X_J instead of T_II (X_I - A_IJ W_J));
A never goes to memory (chunk_intra writes and chunk_solve reads it: 512 B per token and head, fp32 [T, H, 64]).

Not faster on the H200 (RESULTS.md, 2026-12-04, "phases 2 + 3 in one launch"): 2.61 ms vs 2.09 ms for the
four launches at H = 96, T = 4096, 1.29x slower at 64k. Cross-compiled for sm_90 it holds 255 registers and spills
(160 B at 4 warps, 64 B at 8): the 16 x 16 A / T blocks are replicated across the warps of a program, and the
kp / qp row operands of the pair products add 64 registers. Hence ``prefill.MERGE_WY`` off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_intra import _decayed, pair_products
from rocm_k3.triton_kernels.kda.chunk_solve import _mm, invert_diagonal_blocks
from rocm_k3.triton_kernels.kda.common import chunk_bounds


@triton.jit
def _rhs(kn_ptr, v_ptr, gcum_ptr, beta_ptr, t0, n_rows, stride_v, I: tl.constexpr, H: tl.constexpr,
         K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr):
    """Right-hand sides of sub-block I: b * exp(G) * k' [BC, K] and b * v [BC, V], fp32."""
    rows = I * BC + tl.arange(0, BC)
    m = rows < n_rows
    r64 = (t0 + rows).to(tl.int64)[:, None]
    offs_k = r64 * (H * K) + tl.arange(0, K)[None, :]
    b = tl.load(beta_ptr + (t0 + rows).to(tl.int64) * H, mask=m, other=0.0)[:, None]
    g = tl.load(gcum_ptr + offs_k, mask=m[:, None], other=0.0)
    x = tl.load(kn_ptr + offs_k, mask=m[:, None], other=0.0).to(tl.float32) * tl.exp(g) * b
    y = tl.load(v_ptr + r64 * stride_v + tl.arange(0, V)[None, :], mask=m[:, None], other=0.0).to(tl.float32) * b
    return x, y


@triton.jit
def _store_rows(w_ptr, u_ptr, t0, n_rows, I: tl.constexpr, w, u, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BC: tl.constexpr):
    rows = I * BC + tl.arange(0, BC)
    m = (rows < n_rows)[:, None]
    r64 = (t0 + rows).to(tl.int64)[:, None]
    tl.store(w_ptr + r64 * (H * K) + tl.arange(0, K)[None, :], w.to(w_ptr.dtype.element_ty), mask=m)
    tl.store(u_ptr + r64 * (H * V) + tl.arange(0, V)[None, :], u.to(u_ptr.dtype.element_ty), mask=m)


@triton.jit
def _mm32(a, b):
    """fp32 [16, 16] x [16, 16] in IEEE fp32 (the off-diagonal blocks of T)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, I: tl.constexpr, J: tl.constexpr, aqk_h, n_rows,
                H: tl.constexpr, K: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """A_IJ (fp32 [16, 16], returned) and Aqk_IJ (written) for J <= I."""
    BC: tl.constexpr = 16
    BT: tl.constexpr = 64
    r = tl.arange(0, BC)
    kn = tl.trans(_decayed(k_h, g_h, t0 + J * BC, eos, gm, H * K, K, BC, -1.0).to(DOT_T))  # [K, BC]
    a, aqk = pair_products(kp, qp, kn, b, J == I, PREC)
    rows = I * BC + r
    offs = (t0 + rows).to(tl.int64)[:, None] * (H * BT) + J * BC + r[None, :]
    tl.store(aqk_h + offs, aqk.to(aqk_h.dtype.element_ty), mask=(rows < n_rows)[:, None])
    return a


@triton.jit
def _row_block(k_h, g_h, q_h, b_h, t0, eos, n_rows, I: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
               DOT_T: tl.constexpr):
    """Row side of sub-block I: (k' exp(G - m), q' exp(G - m)) in the dot dtype, b [16] and the reference row m."""
    BC: tl.constexpr = 16
    r0 = t0 + I * BC
    rows = r0 + tl.arange(0, BC)
    gm = tl.load(g_h + tl.minimum(r0 + 7, eos - 1).to(tl.int64) * (H * K) + tl.arange(0, K))  # [K]
    b = tl.load(b_h + rows.to(tl.int64) * H, mask=(I * BC + tl.arange(0, BC)) < n_rows, other=0.0)
    kp = _decayed(k_h, g_h, r0, eos, gm, H * K, K, BC, 1.0).to(DOT_T)
    qp = _decayed(q_h, g_h, r0, eos, gm, H * K, K, BC, 1.0).to(DOT_T)
    return kp, qp, b, gm


@triton.jit
def _wy_rows(kn_h, v_h, g_h, b_h, w_h, u_h, t0, n_rows, I: tl.constexpr, t_0, t_1, t_2, t_3,
             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """W_I = sum_{J <= I} T_IJ X_J and U_I likewise (t_J = T_IJ; unused ones are ignored), written."""
    x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n_rows, H * V, 0, H, K, V, 16)
    w = _mm(t_0, x, DOT_T, PREC)
    u = _mm(t_0, y, DOT_T, PREC)
    if I >= 1:
        x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n_rows, H * V, 1, H, K, V, 16)
        w += _mm(t_1, x, DOT_T, PREC)
        u += _mm(t_1, y, DOT_T, PREC)
    if I >= 2:
        x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n_rows, H * V, 2, H, K, V, 16)
        w += _mm(t_2, x, DOT_T, PREC)
        u += _mm(t_2, y, DOT_T, PREC)
    if I >= 3:
        x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n_rows, H * V, 3, H, K, V, 16)
        w += _mm(t_3, x, DOT_T, PREC)
        u += _mm(t_3, y, DOT_T, PREC)
    _store_rows(w_h, u_h, t0, n_rows, I, w, u, H, K, V, 16)


@triton.jit
def chunk_wy_kernel(
    qn_ptr, kn_ptr, v_ptr, gcum_ptr, beta_ptr,  # q', k' [T, H, K]; v [T, H, V]; G fp32 [T, H, K]; b fp32 [T, H]
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan
    aqk_ptr, w_ptr, u_ptr,  # outputs: Aqk [T, H, 64]; W [T, H, K]; U [T, H, V]
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
):
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = chunk_bounds(chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, c, BT)  # rows t0 .. t0 + n - 1
    eos = t0 + n
    q_h, k_h, g_h, b_h = qn_ptr + h * K, kn_ptr + h * K, gcum_ptr + h * K, beta_ptr + h
    aqk_h = aqk_ptr + h * BT
    rt = tl.arange(0, BT)
    upper = ((rt[None, :] // BC) > (rt[:, None] // BC)) & (rt < n)[:, None]  # Aqk blocks J > I: zero
    tl.store(aqk_h + (t0 + rt).to(tl.int64)[:, None] * (H * BT) + rt[None, :],
             tl.zeros([BT, BT], dtype=aqk_ptr.dtype.element_ty), mask=upper)

    # the diagonal blocks first (Aqk_II written), inverted together: four independent chains per step
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 0, H, K, DOT_T)
    a00 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 0, 0, aqk_h, n, H, K, DOT_T, PREC)
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 1, H, K, DOT_T)
    a11 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 1, 1, aqk_h, n, H, K, DOT_T, PREC)
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 2, H, K, DOT_T)
    a22 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 2, 2, aqk_h, n, H, K, DOT_T, PREC)
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 3, H, K, DOT_T)
    a33 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 3, 3, aqk_h, n, H, K, DOT_T, PREC)
    t00, t11, t22, t33 = invert_diagonal_blocks(a00, a11, a22, a33, BC)

    # then block row by block row: A_IJ (J < I, Aqk_IJ written), T_IJ = -T_II sum_{J <= L < I} A_IL T_LJ, W_I, U_I
    v_h, w_h, u_h = v_ptr + h * V, w_ptr + h * K, u_ptr + h * V
    _wy_rows(k_h, v_h, g_h, b_h, w_h, u_h, t0, n, 0, t00, t00, t00, t00, H, K, V, DOT_T, PREC)
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 1, H, K, DOT_T)
    a10 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 1, 0, aqk_h, n, H, K, DOT_T, PREC)
    t10 = -_mm32(t11, _mm32(a10, t00))
    _wy_rows(k_h, v_h, g_h, b_h, w_h, u_h, t0, n, 1, t10, t11, t11, t11, H, K, V, DOT_T, PREC)
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 2, H, K, DOT_T)
    a20 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 2, 0, aqk_h, n, H, K, DOT_T, PREC)
    a21 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 2, 1, aqk_h, n, H, K, DOT_T, PREC)
    t20 = -_mm32(t22, _mm32(a20, t00) + _mm32(a21, t10))
    t21 = -_mm32(t22, _mm32(a21, t11))
    _wy_rows(k_h, v_h, g_h, b_h, w_h, u_h, t0, n, 2, t20, t21, t22, t22, H, K, V, DOT_T, PREC)
    kp, qp, b, gm = _row_block(k_h, g_h, q_h, b_h, t0, eos, n, 3, H, K, DOT_T)
    a30 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 3, 0, aqk_h, n, H, K, DOT_T, PREC)
    a31 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 3, 1, aqk_h, n, H, K, DOT_T, PREC)
    a32 = _pair_block(qp, kp, b, k_h, g_h, t0, eos, gm, 3, 2, aqk_h, n, H, K, DOT_T, PREC)
    t30 = -_mm32(t33, _mm32(a30, t00) + _mm32(a31, t10) + _mm32(a32, t20))
    t31 = -_mm32(t33, _mm32(a31, t11) + _mm32(a32, t21))
    t32 = -_mm32(t33, _mm32(a32, t22))
    _wy_rows(k_h, v_h, g_h, b_h, w_h, u_h, t0, n, 3, t30, t31, t32, t33, H, K, V, DOT_T, PREC)
