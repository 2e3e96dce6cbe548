"""Phase 4 of the chunked KDA prefill: the inter-chunk state recurrence and the output.

One program per (value block, sequence, head) walks the sequence's chunks in order, holding the fp32 state
slice S [K, BV] in registers::

    V' = U - W S                       [C, BV]   (the delta-rule corrected values)
    O  = QG S + Aqk V'                 [C, BV]   (written in o's dtype)
    S  = diag(GL) S + KD^T V'          [K, BV]

With ``SOLVE_IN`` (``prefill.SOLVE_IN_WALK``) there is no W and no U: by associativity
``V' = U - W S = (I + A)^-1 (b v - KB S)``, so each chunk step forms X = b v - KB S and solves it by the block
forward substitution of chunk_solve on [16, BV] row blocks, reading the [T, H, 64] A band whose diagonal blocks
hold T_II = (I + A_II)^-1 (chunk_intra's INVERT_DIAG), KB, v (row-strided) and b; the separate solve launch and
its W / U round trip go away, at the price of the substitution inside the sequential step. Its products run on
16-row tiles::

    X_I  = b_I v_I - KB_I S,   V'_I = T_II (X_I - sum_{J<I} A_IJ V'_J)
    O_I  = QG_I S + sum_{J<=I} Aqk_IJ V'_J,   S = diag(GL) S + sum_J KD_J^T V'_J

With ``WITH_OUTPUT`` false the loop skips the output and instead stores the state at each chunk's start
(``hbuf`` [NC, H, K, V], dot dtype) and V' (``vbuf`` [T, H, V]) for :mod:`.chunk_output`, which computes O for
all chunks in parallel: a shorter sequential step for more bytes moved.

The initial state is read from ``state[state_indices[n]]`` when ``has_initial_state[n]`` (else 0); the final
state is written back to the same slot, in place. ``inter_map[chunk]`` >= 0 asks for the state after that chunk
to be written to row ``inter_map[chunk]`` of the intermediate-state buffer (prefix caching at chunk ends).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.chunk_solve import _mm


@triton.jit
def _step_wu(s_dot, t0, eos, rt, loc_k, loc_v, loc_a, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, o_ptr, vbuf_ptr,
             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WITH_OUTPUT: tl.constexpr, DOT_T: tl.constexpr,
             PREC: tl.constexpr):
    """One chunk from chunk_solve's W and U: V' = U - W S, O (or V' to vbuf), and KD^T V' [K, BV] returned."""
    BT: tl.constexpr = 64
    m = (rt < eos - t0)[:, None]
    w = tl.load(w_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
    u = tl.load(u_ptr + t0 * (H * V) + loc_v, mask=m, other=0.0).to(tl.float32)
    v_dot = (u - tl.dot(w, s_dot, input_precision=PREC)).to(DOT_T)  # [BT, BV]
    if WITH_OUTPUT:
        qg = tl.load(qg_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
        aqk = tl.load(aqk_ptr + t0 * (H * BT) + loc_a, mask=m, other=0.0).to(DOT_T)  # [BT, BT]
        o = tl.dot(qg, s_dot, input_precision=PREC) + tl.dot(aqk, v_dot, input_precision=PREC)
        tl.store(o_ptr + t0 * (H * V) + loc_v, o.to(o_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(vbuf_ptr + t0 * (H * V) + loc_v, v_dot.to(vbuf_ptr.dtype.element_ty), mask=m)
    kd = tl.load(kd_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
    return tl.dot(tl.trans(kd), v_dot, input_precision=PREC)


@triton.jit
def _rows16(ptr, t0, I: tl.constexpr, eos, stride, cols, other):
    """Rows t0 + 16 I .. + 15 of a [T, ...] tensor at columns ``cols`` [C] (offsets within a row), rows past eos
    ``other``: [16, C] as stored."""
    r = tl.arange(0, 16)
    row0 = t0 + I * 16  # int64 scalar base, int32 offsets within the block
    return tl.load(ptr + row0 * stride + (r[:, None] * stride + cols[None, :]), mask=(r < eos - row0)[:, None],
                   other=other)


@triton.jit
def _band(ptr, t0, I: tl.constexpr, J: tl.constexpr, eos, h, H: tl.constexpr):
    """Block (I, J) [16, 16] of a [T, H, 64] row band (rows past eos 0)."""
    return _rows16(ptr, t0, I, eos, H * 64, h * 64 + J * 16 + tl.arange(0, 16), 0.0)


@triton.jit
def _solved_block(I: tl.constexpr, s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v,
                  H: tl.constexpr, K: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """X_I = b_I v_I - KB_I S  [16, BV] fp32 (the right-hand side of row block I before the substitution)."""
    r = t0 + I * 16 + tl.arange(0, 16)
    b = tl.load(b_ptr + r * H + h, mask=r < eos, other=0.0)  # [16]
    v = _rows16(v_ptr, t0, I, eos, stride_v, rv, 0.0).to(tl.float32)  # rv holds h * V + the value columns
    kb = _rows16(kb_ptr, t0, I, eos, H * K, h * K + rk, 0.0)
    return b[:, None] * v - _mm(kb, s_dot, DOT_T, PREC)


@triton.jit
def _lower_sum(acc, ptr, t0, I: tl.constexpr, eos, h, v0, v1, v2, H: tl.constexpr, SIGN: tl.constexpr,
               DOT_T: tl.constexpr, PREC: tl.constexpr):
    """acc + SIGN * sum_{J<I} band_IJ V'_J over the row band at ``ptr`` (A or Aqk) and V'_0..2 (those below I are
    read)."""
    if I > 0:
        acc += SIGN * _mm(_band(ptr, t0, I, 0, eos, h, H), v0, DOT_T, PREC)
    if I > 1:
        acc += SIGN * _mm(_band(ptr, t0, I, 1, eos, h, H), v1, DOT_T, PREC)
    if I > 2:
        acc += SIGN * _mm(_band(ptr, t0, I, 2, eos, h, H), v2, DOT_T, PREC)
    return acc


@triton.jit
def _block_step(I: tl.constexpr, s_dot, t0, eos, h, rk, rv_v, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, kd_ptr,
                aqk_ptr, o_ptr, vbuf_ptr, v0, v1, v2, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                WITH_OUTPUT: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """Row block I of a chunk: V'_I = T_II (X_I - sum_{J<I} A_IJ V'_J) in the dot dtype, returned, and its output
    O_I = QG_I S + sum_{J<=I} Aqk_IJ V'_J (or V'_I to vbuf)."""
    x = _lower_sum(_solved_block(I, s_dot, t0, eos, h, rk, rv_v, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, H, K, DOT_T,
                                 PREC), a_ptr, t0, I, eos, h, v0, v1, v2, H, -1.0, DOT_T, PREC)
    vp = _mm(_band(a_ptr, t0, I, I, eos, h, H), x, DOT_T, PREC).to(DOT_T)
    r = tl.arange(0, 16)
    row0 = t0 + I * 16
    mo = (r < eos - row0)[:, None]
    offs = row0 * (H * V) + (r[:, None] * (H * V) + rv_v[None, :])
    if WITH_OUTPUT:
        o = _mm(_rows16(qg_ptr, t0, I, eos, H * K, h * K + rk, 0.0), s_dot, DOT_T, PREC)
        o = _lower_sum(o + _mm(_band(aqk_ptr, t0, I, I, eos, h, H), vp, DOT_T, PREC), aqk_ptr, t0, I, eos, h,
                       v0, v1, v2, H, 1.0, DOT_T, PREC)
        tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=mo)
    else:
        tl.store(vbuf_ptr + offs, vp.to(vbuf_ptr.dtype.element_ty), mask=mo)
    return vp


@triton.jit
def _step_solved(s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, kd_ptr, aqk_ptr, o_ptr,
                 vbuf_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WITH_OUTPUT: tl.constexpr,
                 DOT_T: tl.constexpr, PREC: tl.constexpr):
    """One chunk with the WY solve inside (SOLVE_IN): the four 16-row blocks in order (block substitution), each
    block's output as soon as its V'_I is known; returns sum_I KD_I^T V'_I [K, BV]."""
    rv_v = h * V + rv  # value columns of head h in v (row stride stride_v) and in o / vbuf (row stride H V)
    v0 = _block_step(0, s_dot, t0, eos, h, rk, rv_v, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, kd_ptr, aqk_ptr,
                     o_ptr, vbuf_ptr, s_dot, s_dot, s_dot, H, K, V, WITH_OUTPUT, DOT_T, PREC)  # reads no V'_J
    v1 = _block_step(1, s_dot, t0, eos, h, rk, rv_v, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, kd_ptr, aqk_ptr,
                     o_ptr, vbuf_ptr, v0, v0, v0, H, K, V, WITH_OUTPUT, DOT_T, PREC)
    v2 = _block_step(2, s_dot, t0, eos, h, rk, rv_v, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, kd_ptr, aqk_ptr,
                     o_ptr, vbuf_ptr, v0, v1, v1, H, K, V, WITH_OUTPUT, DOT_T, PREC)
    v3 = _block_step(3, s_dot, t0, eos, h, rk, rv_v, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr, kd_ptr, aqk_ptr,
                     o_ptr, vbuf_ptr, v0, v1, v2, H, K, V, WITH_OUTPUT, DOT_T, PREC)
    # the state update after the outputs (the [K, BV] accumulator is not live across them: fewer registers)
    kd = h * K + rk
    upd = _mm(tl.trans(_rows16(kd_ptr, t0, 0, eos, H * K, kd, 0.0)), v0, DOT_T, PREC)
    upd += _mm(tl.trans(_rows16(kd_ptr, t0, 1, eos, H * K, kd, 0.0)), v1, DOT_T, PREC)
    upd += _mm(tl.trans(_rows16(kd_ptr, t0, 2, eos, H * K, kd, 0.0)), v2, DOT_T, PREC)
    return upd + _mm(tl.trans(_rows16(kd_ptr, t0, 3, eos, H * K, kd, 0.0)), v3, DOT_T, PREC)


@triton.jit
def _step_horner(s, s_dot, gl, t0, eos, h, rt, rv, loc_k, loc_v, loc_a, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v, qg_ptr,
                 kd_ptr, aqk_ptr, o_ptr, vbuf_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 WITH_OUTPUT: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """One chunk with the solve as whole-chunk products (HORNER): with D = blockdiag(I + A_II) (the band's diagonal
    blocks hold T_II = D_II^-1) and N the blocks of A below the diagonal, I + A = D (I + L), L = T_D N, strictly lower
    by 16-row blocks, so L^4 = 0 and (I + L)^-1 = (I - L)(I + L^2)::

        Y = T_D (b v - KB S),   V' = (I - L)(I + L^2) Y        [C, BV]

    The dependent chain is KB S, T_D X, L^2 Y, -L W, KD^T V' ([64, 64] x [64, BV] products; L^2 = (-L)(-L) does not
    wait for S) instead of the ten dependent [16, *] products of the block substitution; the chunk's tiles are
    loaded whole. The band's blocks below the diagonal hold -L (chunk_intra's NEG_L). Returns the state after the
    chunk, diag(GL) S + KD^T V' (accumulated onto the decayed S)."""
    BT: tl.constexpr = 64
    rvalid = rt < eos - t0
    m = rvalid[:, None]
    band = tl.load(a_ptr + t0 * (H * BT) + loc_a, mask=m, other=0.0)  # [BT, BT]: T_II diagonal, -L below
    blk = rt // 16
    t_d = tl.where(blk[:, None] == blk[None, :], band, 0.0).to(DOT_T)
    neg_l = tl.where(blk[:, None] > blk[None, :], band, 0.0).to(DOT_T)
    kb = tl.load(kb_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)  # [BT, K]
    b = tl.load(b_ptr + (t0 + rt) * H + h, mask=rvalid, other=0.0)  # [BT]
    v = tl.load(v_ptr + t0 * stride_v + (rt[:, None] * stride_v + h * V + rv[None, :]), mask=m, other=0.0)
    x = b[:, None] * v.to(tl.float32) - tl.dot(kb, s_dot, input_precision=PREC)  # [BT, BV]
    y = tl.dot(t_d, x.to(DOT_T), input_precision=PREC)
    l2 = tl.dot(neg_l, neg_l, input_precision=PREC).to(DOT_T)  # L^2 (does not wait for S)
    w = tl.dot(l2, y.to(DOT_T), acc=y, input_precision=PREC)  # (I + L^2) Y
    vp = tl.dot(neg_l, w.to(DOT_T), acc=w, input_precision=PREC).to(DOT_T)  # V' = (I - L)(I + L^2) Y [BT, BV]
    if WITH_OUTPUT:
        qg = tl.load(qg_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
        aqk = tl.load(aqk_ptr + t0 * (H * BT) + loc_a, mask=m, other=0.0).to(DOT_T)  # [BT, BT], zero above
        o = tl.dot(aqk, vp, acc=tl.dot(qg, s_dot, input_precision=PREC), input_precision=PREC)
        tl.store(o_ptr + t0 * (H * V) + loc_v, o.to(o_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(vbuf_ptr + t0 * (H * V) + loc_v, vp.to(vbuf_ptr.dtype.element_ty), mask=m)
    kd = tl.load(kd_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
    return tl.dot(tl.trans(kd), vp, acc=s * gl[:, None], input_precision=PREC)


@triton.jit
def chunk_state_kernel(
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, glast_ptr,  # outputs of phases 1-3 (see prefill.py)
    cu_seqlens_ptr, seq_first_chunk_ptr,  # int32 [N+1] each
    state_ptr, state_indices_ptr, has_init_ptr,  # fp32 [S, H, K, V]; int32 [N]; int8 [N]
    o_ptr, inter_ptr, inter_map_ptr,  # o [T, H, V]; fp32 [M, H, K, V]; int32 [NC] (read when HAS_INTER)
    hbuf_ptr, vbuf_ptr,  # without WITH_OUTPUT: chunk-start states [NC, H, K, V] and V' [T, H, V]
    a_ptr, kb_ptr, v_ptr, b_ptr, stride_v,  # SOLVE_IN: A band [T, H, 64] (fp32 or bf16; T_II diagonal; HORNER:
    # -L below the diagonal, chunk_intra's NEG_L), KB, v, b
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    HAS_INTER: tl.constexpr, WITH_OUTPUT: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
    SOLVE_IN: tl.constexpr, HORNER: tl.constexpr = False,
):
    """Grid (V / BV, N, H). Without SOLVE_IN, w_ptr / u_ptr hold chunk_solve's W / U and a_ptr .. b_ptr are unread;
    with it, w_ptr / u_ptr are unread."""
    BT: tl.constexpr = 64
    tl.static_assert(not HORNER or SOLVE_IN, "HORNER is a way for the walk to solve: it needs SOLVE_IN")
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
    s_offs = rk[:, None] * V + rv[None, :]  # [K, BV] inside one [K, V] head state
    state_h = state_ptr + (slot * H + h) * (K * V)
    if has_init != 0:
        s = tl.load(state_h + s_offs)
    else:
        s = tl.zeros([K, BV], dtype=tl.float32)

    rt = tl.arange(0, BT)
    loc_k = rt[:, None] * (H * K) + h * K + rk[None, :]  # int32 offsets of a [BT, K] tile from its chunk's row 0
    loc_v = rt[:, None] * (H * V) + h * V + rv[None, :]  # [BT, BV]
    loc_a = rt[:, None] * (H * BT) + h * BT + rt[None, :]  # [BT, BT]
    for ci in range(0, n_chunks):
        t0 = (bos + ci * BT).to(tl.int64)  # scalar 64-bit row base; the tiles add 32-bit offsets
        s_dot = s.to(DOT_T)
        if not WITH_OUTPUT:
            h_c = hbuf_ptr + ((c_first + ci) * H + h).to(tl.int64) * (K * V)
            tl.store(h_c + s_offs, s_dot.to(hbuf_ptr.dtype.element_ty))
        gl = tl.load(glast_ptr + ((c_first + ci) * H + h).to(tl.int64) * K + rk)  # [K]
        if SOLVE_IN and HORNER:
            s = _step_horner(s, s_dot, gl, t0, eos, h, rt, rv, loc_k, loc_v, loc_a, a_ptr, kb_ptr, v_ptr, b_ptr,
                             stride_v, qg_ptr, kd_ptr, aqk_ptr, o_ptr, vbuf_ptr, H, K, V, WITH_OUTPUT, DOT_T, PREC)
        elif SOLVE_IN:
            s = s * gl[:, None] + _step_solved(s_dot, t0, eos, h, rk, rv, a_ptr, kb_ptr, v_ptr, b_ptr, stride_v,
                                               qg_ptr, kd_ptr, aqk_ptr, o_ptr, vbuf_ptr, H, K, V, WITH_OUTPUT, DOT_T,
                                               PREC)
        else:
            s = s * gl[:, None] + _step_wu(s_dot, t0, eos, rt, loc_k, loc_v, loc_a, w_ptr, u_ptr, qg_ptr, kd_ptr,
                                           aqk_ptr, o_ptr, vbuf_ptr, H, K, V, WITH_OUTPUT, DOT_T, PREC)
        if HAS_INTER:
            row = tl.load(inter_map_ptr + c_first + ci)
            if row >= 0:
                tl.store(inter_ptr + (row.to(tl.int64) * H + h) * (K * V) + s_offs, s)
    tl.store(state_h + s_offs, s)
