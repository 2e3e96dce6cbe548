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
def _invert_by_products(a, BC: tl.constexpr):
    """(I + a)^-1 of one strictly lower [16, 16] block as (I - a)(I + a^2)(I + a^4)(I + a^8) (a^16 = 0: the
    telescoping product is I - a^16 = I once multiplied by I + a): six fp32 16 x 16 x 16 products, four dependent
    levels, instead of 15 dependent row steps of two cross-thread reductions each. Kept in fp32 ("ieee"): for
    strongly correlated keys and weak decay the powers of a grow like binomials (entries ~3e3 at a^8) and the product
    cancels back to O(1), so tf32 operands (11 bits) would leave errors of order 1 (a session-20 review; the option
    was dropped untimed)."""
    tl.static_assert(BC == 16)
    r = tl.arange(0, BC)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    a2 = tl.dot(a, a, input_precision="ieee")
    a4 = tl.dot(a2, a2, input_precision="ieee")
    t = tl.dot(eye - a, eye + a2, input_precision="ieee")
    a8 = tl.dot(a4, a4, input_precision="ieee")
    t = tl.dot(t, eye + a4, input_precision="ieee")
    return tl.dot(t, eye + a8, input_precision="ieee")


@triton.jit
def invert_diagonal_block(a, BC: tl.constexpr, BY_PRODUCTS: tl.constexpr = False):
    """(I + a)^-1 of one strictly lower [BC, BC] block in fp32 (chunk_intra's INVERT_DIAG): row by row, or
    (BY_PRODUCTS) as a product of four factors (_invert_by_products)."""
    if BY_PRODUCTS:
        return _invert_by_products(a, BC)
    r = tl.arange(0, BC)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BC):
        t = _substitute_row(a, t, i, r)
    return t


@triton.jit
def invert_diagonal_blocks(a00, a11, a22, a33, BC: tl.constexpr, BY_PRODUCTS: tl.constexpr = False):
    """(I + a_II)^-1 of the four strictly lower [BC, BC] diagonal blocks in fp32: row by row, inverted together
    (four independent chains per step), or (BY_PRODUCTS) each as a product of four factors."""
    if BY_PRODUCTS:
        return (_invert_by_products(a00, BC), _invert_by_products(a11, BC), _invert_by_products(a22, BC),
                _invert_by_products(a33, BC))
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
def _mm(a, b, DOT_T: tl.constexpr, PREC: tl.constexpr):
    return tl.dot(a.to(DOT_T), b.to(DOT_T), input_precision=PREC)


@triton.jit
def _rhs_cols(x_ptr, g_ptr, beta_ptr, t0, n_rows, stride, I: tl.constexpr, H: tl.constexpr, BC: tl.constexpr,
              BD: tl.constexpr, DECAY: tl.constexpr, SCALE_B: tl.constexpr):
    """[BC, BD] columns of sub-block I's right-hand side, fp32: b * exp(G) * k' (DECAY, G from g_ptr, same
    stride), b * v, or (not SCALE_B) x as stored (chunk_intra's KB = b * exp(G) * k')."""
    rows = I * BC + tl.arange(0, BC)
    m = rows < n_rows
    offs = (t0 + rows).to(tl.int64)[:, None] * stride + tl.arange(0, BD)[None, :]
    x = tl.load(x_ptr + offs, mask=m[:, None], other=0.0).to(tl.float32)
    if DECAY:
        x = x * tl.exp(tl.load(g_ptr + offs, mask=m[:, None], other=0.0))
    if SCALE_B:
        x = x * tl.load(beta_ptr + (t0 + rows).to(tl.int64) * H, mask=m, other=0.0)[:, None]
    return x


@triton.jit
def _store_cols(y_ptr, t0, n_rows, stride, I: tl.constexpr, y, BC: tl.constexpr, BD: tl.constexpr):
    rows = I * BC + tl.arange(0, BC)
    offs = (t0 + rows).to(tl.int64)[:, None] * stride + tl.arange(0, BD)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=(rows < n_rows)[:, None])


@triton.jit
def _solve_cols(a_h, t0, n, sa, t00, t11, t22, t33, x_ptr, g_ptr, beta_ptr, stride_x, y_ptr, stride_y,
                H: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, DECAY: tl.constexpr, SCALE_B: tl.constexpr,
                DOT_T: tl.constexpr, PREC: tl.constexpr):
    """Y = (I + A)^-1 X on [64, BD] columns by block forward substitution: Y_I = T_II (X_I - sum_{J<I} A_IJ Y_J).
    Y_J is held in the dot dtype once computed (it enters the later products rounded to it anyway, and is stored
    from it)."""
    x = _rhs_cols(x_ptr, g_ptr, beta_ptr, t0, n, stride_x, 0, H, BC, BD, DECAY, SCALE_B)
    y0 = _mm(t00, x, DOT_T, PREC).to(DOT_T)
    _store_cols(y_ptr, t0, n, stride_y, 0, y0, BC, BD)
    x = _rhs_cols(x_ptr, g_ptr, beta_ptr, t0, n, stride_x, 1, H, BC, BD, DECAY, SCALE_B)
    y1 = _mm(t11, x - _mm(_load_block(a_h, t0, n, 1, 0, sa, BC), y0, DOT_T, PREC), DOT_T, PREC).to(DOT_T)
    _store_cols(y_ptr, t0, n, stride_y, 1, y1, BC, BD)
    x = _rhs_cols(x_ptr, g_ptr, beta_ptr, t0, n, stride_x, 2, H, BC, BD, DECAY, SCALE_B)
    x -= _mm(_load_block(a_h, t0, n, 2, 0, sa, BC), y0, DOT_T, PREC)
    x -= _mm(_load_block(a_h, t0, n, 2, 1, sa, BC), y1, DOT_T, PREC)
    y2 = _mm(t22, x, DOT_T, PREC).to(DOT_T)
    _store_cols(y_ptr, t0, n, stride_y, 2, y2, BC, BD)
    x = _rhs_cols(x_ptr, g_ptr, beta_ptr, t0, n, stride_x, 3, H, BC, BD, DECAY, SCALE_B)
    x -= _mm(_load_block(a_h, t0, n, 3, 0, sa, BC), y0, DOT_T, PREC)
    x -= _mm(_load_block(a_h, t0, n, 3, 1, sa, BC), y1, DOT_T, PREC)
    x -= _mm(_load_block(a_h, t0, n, 3, 2, sa, BC), y2, DOT_T, PREC)
    _store_cols(y_ptr, t0, n, stride_y, 3, _mm(t33, x, DOT_T, PREC), BC, BD)


@triton.jit
def chunk_solve_kernel(
    a_ptr, kn_ptr, v_ptr, gcum_ptr, beta_ptr,  # A fp32 [T, H, 64]; k' or KB [T, H, K]; v [T, H, V]; G fp32; b fp32
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan
    w_ptr, u_ptr,  # outputs: W [T, H, K], U [T, H, V]
    stride_v,  # token-row stride of v in elements (head stride V, element stride 1; the rest is contiguous)
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BD: tl.constexpr, DOT_T: tl.constexpr,
    PREC: tl.constexpr, KB: tl.constexpr, DIAG_INVERTED: tl.constexpr, INVERT_PRODUCTS: tl.constexpr,
):
    """One program per (chunk, head, BD-column block of [W | U]): blocks 0 .. K / BD - 1 are W's, the rest U's.
    Each program inverts the diagonal blocks itself (15 dependent row steps on four [16, 16] blocks) unless
    DIAG_INVERTED: then chunk_intra (INVERT_DIAG) stored T_II = (I + A_II)^-1 in A's diagonal blocks, once per
    (chunk, head) instead of once per column block. Fewer columns per program hold fewer registers, so more
    programs share an SM. With KB, kn_ptr holds chunk_intra's KB (the finished right-hand side of W) and G is not
    read."""
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    c = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    t0, n = chunk_bounds(chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, c, BT)  # rows t0 .. t0 + n - 1
    sa = H * BT
    a_h = a_ptr + h * BT
    t00 = _load_block(a_h, t0, n, 0, 0, sa, BC)
    t11 = _load_block(a_h, t0, n, 1, 1, sa, BC)
    t22 = _load_block(a_h, t0, n, 2, 2, sa, BC)
    t33 = _load_block(a_h, t0, n, 3, 3, sa, BC)
    if not DIAG_INVERTED:  # the loaded blocks are A_II: invert them here
        t00, t11, t22, t33 = invert_diagonal_blocks(t00, t11, t22, t33, BC, INVERT_PRODUCTS)
    if p < K // BD:
        col = p * BD + h * K
        _solve_cols(a_h, t0, n, sa, t00, t11, t22, t33, kn_ptr + col, gcum_ptr + col, beta_ptr + h, H * K,
                    w_ptr + col, H * K, H, BC, BD, not KB, not KB, DOT_T, PREC)
    else:
        col = (p - K // BD) * BD + h * V
        _solve_cols(a_h, t0, n, sa, t00, t11, t22, t33, v_ptr + col, gcum_ptr, beta_ptr + h, stride_v,
                    u_ptr + col, H * V, H, BC, BD, False, True, DOT_T, PREC)
