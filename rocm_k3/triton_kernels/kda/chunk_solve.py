"""Phase 3 of the chunked KDA prefill: the WY solve, one program per (chunk, head).

With A the strictly lower in-chunk matrix of phase 2 (b already folded into its rows)::

    T = (I + A)^-1                      fp32 [64, 64], forward substitution row by row (T_i = e_i - A_i T)
    W = T (b * exp(G) * k')             [64, K]   (activation dtype)
    U = T (b * v)                       [64, V]

Rows past the chunk's end have zero A rows and zero right-hand sides, so they contribute nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_solve_kernel(
    a_ptr, kn_ptr, v_ptr, gcum_ptr, beta_ptr,  # A fp32 [T, H, 64]; k' [T, H, K]; v [T, H, V]; G fp32; b fp32 [T, H]
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan
    w_ptr, u_ptr,  # outputs: W [T, H, K], U [T, H, V]
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
):
    BT: tl.constexpr = 64
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    n_rows = tl.minimum(tl.load(cu_seqlens_ptr + seq + 1), t0 + BT) - t0
    r = tl.arange(0, BT)
    a_row = a_ptr + t0.to(tl.int64) * (H * BT) + h * BT + r  # row 0 of this chunk's A band, [BT] columns
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)  # [BT, BT]
    for i in range(1, n_rows):
        a_i = tl.load(a_row + i * (H * BT))  # row i of A, indexed by column j
        new = -tl.sum(a_i[:, None] * t, axis=0)  # -(sum_j A_ij T_j); rows j < i are final
        new = tl.where(r == i, 1.0, new)
        t = tl.where(r[:, None] == i, new[None, :], t)

    rows = t0 + r
    m = (r < n_rows)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    offs_k = r64 * (H * K) + h * K + tl.arange(0, K)[None, :]  # [BT, K]
    offs_v = r64 * (H * V) + h * V + tl.arange(0, V)[None, :]  # [BT, V]
    b = tl.load(beta_ptr + rows.to(tl.int64) * H + h, mask=r < n_rows, other=0.0)[:, None]  # [BT, 1]
    g = tl.load(gcum_ptr + offs_k, mask=m, other=0.0)
    x = tl.load(kn_ptr + offs_k, mask=m, other=0.0).to(tl.float32) * tl.exp(g) * b  # b * exp(G) * k'
    y = tl.load(v_ptr + offs_v, mask=m, other=0.0).to(tl.float32) * b
    t_dot = t.to(DOT_T)
    w = tl.dot(t_dot, x.to(DOT_T), input_precision=PREC)
    u = tl.dot(t_dot, y.to(DOT_T), input_precision=PREC)
    tl.store(w_ptr + offs_k, w.to(w_ptr.dtype.element_ty), mask=m)
    tl.store(u_ptr + offs_v, u.to(u_ptr.dtype.element_ty), mask=m)
