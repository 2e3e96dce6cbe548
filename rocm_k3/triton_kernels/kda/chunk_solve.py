"""Phase 3 of the chunked KDA prefill: the WY solve, one program per (chunk, head).

With A the strictly lower in-chunk matrix of phase 2 (b already folded into its rows), W and U solve::

    (I + A) W = b * exp(G) * k'      [64, K]        (I + A) U = b * v      [64, V]

by block forward substitution over the four 16-row sub-blocks (A_IJ = 16 x 16 blocks)::

    T_II = (I + A_II)^-1                                  (the four diagonal blocks inverted together,
                                                           row by row: T_i = e_i - A_i T, fp32)
    W_I  = T_II (X_I - sum_{J<I} A_IJ W_J)                 and the same for U

which is the WY form W = (I + A)^-1 X without forming the 64 x 64 inverse. Rows past the chunk's end have zero
A rows and zero right-hand sides. Dot operands are bf16 for bf16 activations (fp32 accumulation), else fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.common import chunk_bounds


@triton.jit
def _load_block(a_ptr, t0, n_rows, I: tl.constexpr, J: tl.constexpr, stride, BC: tl.constexpr):
    """A_IJ as fp32 [BC, BC] (rows past the chunk's end are 0)."""
    r = tl.arange(0, BC)
    rows = I * BC + r
    offs = (t0 + rows).to(tl.int64)[:, None] * stride + J * BC + r[None, :]
    return tl.load(a_ptr + offs, mask=(rows < n_rows)[:, None], other=0.0)


@triton.jit
def _substitute_row(a, t, i, r):
    """Row i of (I + a)^-1 given its rows < i in t: t_i = e_i - sum_j a_ij t_j (a strictly lower)."""
    a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)  # row i of a, indexed by column j
    new = tl.where(r == i, 1.0, -tl.sum(a_i[:, None] * t, axis=0))
    return tl.where(r[:, None] == i, new[None, :], t)


@triton.jit
def invert_diagonal_blocks(a00, a11, a22, a33, BC: tl.constexpr):
    """(I + a_II)^-1 of the four strictly lower [BC, BC] diagonal blocks, row by row in fp32, inverted together
    (four independent chains per step)."""
    r = tl.arange(0, BC)
    t00 = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t11 = t00
    t22 = t00
    t33 = t00
    for i in range(1, BC):
        t00 = _substitute_row(a00, t00, i, r)
        t11 = _substitute_row(a11, t11, i, r)
        t22 = _substitute_row(a22, t22, i, r)
        t33 = _substitute_row(a33, t33, i, r)
    return t00, t11, t22, t33


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
def _mm(a, b, DOT_T: tl.constexpr, PREC: tl.constexpr):
    return tl.dot(a.to(DOT_T), b.to(DOT_T), input_precision=PREC)


@triton.jit
def _store_rows(w_ptr, u_ptr, t0, n_rows, I: tl.constexpr, w, u, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BC: tl.constexpr):
    rows = I * BC + tl.arange(0, BC)
    m = (rows < n_rows)[:, None]
    r64 = (t0 + rows).to(tl.int64)[:, None]
    tl.store(w_ptr + r64 * (H * K) + tl.arange(0, K)[None, :], w.to(w_ptr.dtype.element_ty), mask=m)
    tl.store(u_ptr + r64 * (H * V) + tl.arange(0, V)[None, :], u.to(u_ptr.dtype.element_ty), mask=m)


@triton.jit
def chunk_solve_kernel(
    a_ptr, kn_ptr, v_ptr, gcum_ptr, beta_ptr,  # A fp32 [T, H, 64]; k' [T, H, K]; v [T, H, V]; G fp32; b fp32 [T, H]
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan
    w_ptr, u_ptr,  # outputs: W [T, H, K], U [T, H, V]
    stride_v,  # token-row stride of v in elements (head stride V, element stride 1; the rest is contiguous)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
):
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0, n = chunk_bounds(chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, c, BT)  # rows t0 .. t0 + n - 1
    sa = H * BT
    a_h = a_ptr + h * BT
    r = tl.arange(0, BC)

    t00, t11, t22, t33 = invert_diagonal_blocks(
        _load_block(a_h, t0, n, 0, 0, sa, BC), _load_block(a_h, t0, n, 1, 1, sa, BC),
        _load_block(a_h, t0, n, 2, 2, sa, BC), _load_block(a_h, t0, n, 3, 3, sa, BC), BC)

    kn_h, v_h, g_h, b_h = kn_ptr + h * K, v_ptr + h * V, gcum_ptr + h * K, beta_ptr + h
    w_h, u_h = w_ptr + h * K, u_ptr + h * V
    # block forward substitution: W_I = T_II (X_I - sum_{J<I} A_IJ W_J), same for U
    x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n, stride_v, 0, H, K, V, BC)
    w0 = _mm(t00, x, DOT_T, PREC)
    u0 = _mm(t00, y, DOT_T, PREC)
    _store_rows(w_h, u_h, t0, n, 0, w0, u0, H, K, V, BC)

    x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n, stride_v, 1, H, K, V, BC)
    a10 = _load_block(a_h, t0, n, 1, 0, sa, BC)
    w1 = _mm(t11, x - _mm(a10, w0, DOT_T, PREC), DOT_T, PREC)
    u1 = _mm(t11, y - _mm(a10, u0, DOT_T, PREC), DOT_T, PREC)
    _store_rows(w_h, u_h, t0, n, 1, w1, u1, H, K, V, BC)

    x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n, stride_v, 2, H, K, V, BC)
    a20 = _load_block(a_h, t0, n, 2, 0, sa, BC)
    a21 = _load_block(a_h, t0, n, 2, 1, sa, BC)
    w2 = _mm(t22, x - _mm(a20, w0, DOT_T, PREC) - _mm(a21, w1, DOT_T, PREC), DOT_T, PREC)
    u2 = _mm(t22, y - _mm(a20, u0, DOT_T, PREC) - _mm(a21, u1, DOT_T, PREC), DOT_T, PREC)
    _store_rows(w_h, u_h, t0, n, 2, w2, u2, H, K, V, BC)

    x, y = _rhs(kn_h, v_h, g_h, b_h, t0, n, stride_v, 3, H, K, V, BC)
    a30 = _load_block(a_h, t0, n, 3, 0, sa, BC)
    a31 = _load_block(a_h, t0, n, 3, 1, sa, BC)
    a32 = _load_block(a_h, t0, n, 3, 2, sa, BC)
    w3 = _mm(t33, x - _mm(a30, w0, DOT_T, PREC) - _mm(a31, w1, DOT_T, PREC) - _mm(a32, w2, DOT_T, PREC),
             DOT_T, PREC)
    u3 = _mm(t33, y - _mm(a30, u0, DOT_T, PREC) - _mm(a31, u1, DOT_T, PREC) - _mm(a32, u2, DOT_T, PREC),
             DOT_T, PREC)
    _store_rows(w_h, u_h, t0, n, 3, w3, u3, H, K, V, BC)
