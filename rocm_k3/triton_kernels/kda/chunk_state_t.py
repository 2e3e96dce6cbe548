"""The solving state walk (chunk_state's SOLVE_IN) computed transposed: one program per (value block, sequence,
head) holds S^T [BV, K] instead of S [K, BV].

Same recurrence as :mod:`.chunk_state` with SOLVE_IN and the output (``prefill.WALK_TRANSPOSED``), each product
written for the transposes, so that every operand produced inside the step (the state, the right-hand sides, the
solved rows V'_J) is the *left* operand of the next product::

    X^T_I  = b_I v^T_I - S^T KB_I^T                                   [BV, 16]
    V'^T_I = (X^T_I - sum_{J<I} V'^T_J A_IJ^T) T_II^T                 [BV, 16]
    O^T_I  = S^T QG_I^T + sum_{J<=I} V'^T_J Aqk_IJ^T                  [BV, 16] (stored as o's rows)
    S^T    = S^T diag(GL) + sum_I V'^T_I KD_I                         [BV, K]

A product's result (accumulator layout) feeds the next product's left operand through registers (the
accumulator-to-operand relabelling Triton does for attention's P V), where the [K, BV] form of chunk_state passes
each V'_J to its right operand through shared memory and a barrier. Only the tiles read from memory (KB, A, Aqk,
QG, KD rows, seen transposed) are right operands, which the pipeliner stages in shared memory anyway. With BV rows
per program, the products are M = BV (one warpgroup of 4 warps at BV = 64).

The initial state is read from ``state[state_indices[n]]`` when ``has_initial_state[n]`` (else 0) and the final
state written back in place; ``inter_map[chunk]`` >= 0 stores the state after that chunk at that row of ``inter``
(prefix caching), as in chunk_state.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows_t(ptr, row0, eos, stride, cols, other, DIRECT: tl.constexpr = False):
    """Rows row0 .. row0 + 15 of a [T, ...] tensor at columns ``cols`` [C] (offsets within a row), transposed:
    [C, 16]; rows past eos ``other``. DIRECT: a volatile load, which Triton's pipeliner leaves in place (straight to
    registers, no shared-memory stage)."""
    r = tl.arange(0, 16)
    return tl.load(ptr + row0 * stride + (r[None, :] * stride + cols[:, None]), mask=(r < eos - row0)[None, :],
                   other=other, volatile=DIRECT)


@triton.jit
def _rows(ptr, row0, eos, stride, cols, other):
    """Rows row0 .. row0 + 15 of a [T, ...] tensor at columns ``cols`` [C]: [16, C] as stored; rows past eos
    ``other``."""
    r = tl.arange(0, 16)
    return tl.load(ptr + row0 * stride + (r[:, None] * stride + cols[None, :]), mask=(r < eos - row0)[:, None],
                   other=other)


@triton.jit
def _band_t(ptr, row0, eos, h, J: tl.constexpr, H: tl.constexpr, DIRECT: tl.constexpr = False):
    """Block (I, J)^T [16, 16] of a [T, H, 64] row band (rows row0 .. row0 + 15 of block row I; rows past eos 0):
    element [j, i] = band[row0 + i, 16 J + j]."""
    return _rows_t(ptr, row0, eos, H * 64, h * 64 + J * 16 + tl.arange(0, 16), 0.0, DIRECT)


@triton.jit
def _block_t(I: tl.constexpr, s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, aqk_ptr,
             o_ptr, w0, w1, w2, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DOT_T: tl.constexpr,
             PREC: tl.constexpr, DIRECT_V: tl.constexpr):
    """Row block I of a chunk: V'^T_I [BV, 16] in the dot dtype, returned; O_I stored."""
    row0 = t0 + I * 16
    r = row0 + tl.arange(0, 16)
    b = tl.load(b_ptr + r * H + h, mask=r < eos, other=0.0, volatile=DIRECT_V)  # [16]
    v_t = _rows_t(v_ptr, row0, eos, stride_v, h * V + rv, 0.0, DIRECT_V).to(tl.float32)  # [BV, 16]
    kb_t = _rows_t(kb_ptr, row0, eos, H * K, h * K + rk, 0.0).to(DOT_T)  # [K, 16]
    x = b[None, :] * v_t - tl.dot(s_dot, kb_t, input_precision=PREC)
    if I > 0:
        x -= tl.dot(w0, _band_t(a_ptr, row0, eos, h, 0, H, DIRECT_V).to(DOT_T), input_precision=PREC)
    if I > 1:
        x -= tl.dot(w1, _band_t(a_ptr, row0, eos, h, 1, H, DIRECT_V).to(DOT_T), input_precision=PREC)
    if I > 2:
        x -= tl.dot(w2, _band_t(a_ptr, row0, eos, h, 2, H, DIRECT_V).to(DOT_T), input_precision=PREC)
    vp = tl.dot(x.to(DOT_T), _band_t(a_ptr, row0, eos, h, I, H, DIRECT_V).to(DOT_T), input_precision=PREC).to(DOT_T)
    o = tl.dot(s_dot, _rows_t(qg_ptr, row0, eos, H * K, h * K + rk, 0.0).to(DOT_T), input_precision=PREC)
    o = tl.dot(vp, _band_t(aqk_ptr, row0, eos, h, I, H, DIRECT_V).to(DOT_T), o, input_precision=PREC)
    if I > 0:
        o = tl.dot(w0, _band_t(aqk_ptr, row0, eos, h, 0, H, DIRECT_V).to(DOT_T), o, input_precision=PREC)
    if I > 1:
        o = tl.dot(w1, _band_t(aqk_ptr, row0, eos, h, 1, H, DIRECT_V).to(DOT_T), o, input_precision=PREC)
    if I > 2:
        o = tl.dot(w2, _band_t(aqk_ptr, row0, eos, h, 2, H, DIRECT_V).to(DOT_T), o, input_precision=PREC)
    ri = tl.arange(0, 16)
    offs = row0 * (H * V) + (ri[None, :] * (H * V) + (h * V + rv)[:, None])  # [BV, 16]
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=(ri < eos - row0)[None, :])
    return vp


@triton.jit
def chunk_state_t_kernel(
    qg_ptr, kd_ptr, aqk_ptr, glast_ptr,  # QG, KD [T, H, K]; Aqk band [T, H, 64]; GL fp32 [NC, H, K]
    cu_seqlens_ptr, seq_first_chunk_ptr,  # int32 [N+1] each
    state_ptr, state_indices_ptr, has_init_ptr,  # fp32 [S, H, K, V]; int32 [N]; int8 [N]
    o_ptr, inter_ptr, inter_map_ptr,  # o [T, H, V]; fp32 [M, H, K, V]; int32 [NC] (read when HAS_INTER)
    a_ptr, kb_ptr, v_ptr, b_ptr, stride_v,  # A band [T, H, 64] (T_II diagonal), KB [T, H, K], v (row-strided), b
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    HAS_INTER: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr, DIRECT_V: tl.constexpr = False,
):
    """Grid (V / BV, N, H)."""
    BT: tl.constexpr = 64
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + n)
    eos = tl.load(cu_seqlens_ptr + n + 1)
    c_first = tl.load(seq_first_chunk_ptr + n)
    n_chunks = tl.load(seq_first_chunk_ptr + n + 1) - c_first
    slot = tl.load(state_indices_ptr + n).to(tl.int64)
    has_init = tl.load(has_init_ptr + n)

    rk = tl.arange(0, K)
    rv = iv * BV + tl.arange(0, BV)
    s_offs = rk[None, :] * V + rv[:, None]  # [BV, K]: S^T inside one [K, V] head state
    state_h = state_ptr + (slot * H + h) * (K * V)
    if has_init != 0:
        s = tl.load(state_h + s_offs)
    else:
        s = tl.zeros([BV, K], dtype=tl.float32)

    for ci in range(0, n_chunks):
        t0 = (bos + ci * BT).to(tl.int64)  # scalar 64-bit row base; the tiles add 32-bit offsets
        s_dot = s.to(DOT_T)
        gl = tl.load(glast_ptr + ((c_first + ci) * H + h).to(tl.int64) * K + rk)  # [K]
        s = s * gl[None, :]  # S^T diag(GL); the step's products read s_dot (the state at the chunk's start)
        kd_cols = h * K + rk
        w0 = _block_t(0, s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, aqk_ptr, o_ptr,
                      s_dot, s_dot, s_dot, H, K, V, DOT_T, PREC, DIRECT_V)
        s = tl.dot(w0, _rows(kd_ptr, t0, eos, H * K, kd_cols, 0.0).to(DOT_T), s, input_precision=PREC)
        w1 = _block_t(1, s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, aqk_ptr, o_ptr,
                      w0, w0, w0, H, K, V, DOT_T, PREC, DIRECT_V)
        s = tl.dot(w1, _rows(kd_ptr, t0 + 16, eos, H * K, kd_cols, 0.0).to(DOT_T), s,
                   input_precision=PREC)
        w2 = _block_t(2, s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, aqk_ptr, o_ptr,
                      w0, w1, w1, H, K, V, DOT_T, PREC, DIRECT_V)
        s = tl.dot(w2, _rows(kd_ptr, t0 + 32, eos, H * K, kd_cols, 0.0).to(DOT_T), s,
                   input_precision=PREC)
        w3 = _block_t(3, s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, aqk_ptr, o_ptr,
                      w0, w1, w2, H, K, V, DOT_T, PREC, DIRECT_V)
        s = tl.dot(w3, _rows(kd_ptr, t0 + 48, eos, H * K, kd_cols, 0.0).to(DOT_T), s,
                   input_precision=PREC)
        if HAS_INTER:
            row = tl.load(inter_map_ptr + c_first + ci)
            if row >= 0:
                tl.store(inter_ptr + (row.to(tl.int64) * H + h) * (K * V) + s_offs, s)
    tl.store(state_h + s_offs, s)
