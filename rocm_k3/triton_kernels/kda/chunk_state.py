"""Phase 4 of the chunked KDA prefill: the inter-chunk state recurrence and the output.

One program per (value block, sequence, head) walks the sequence's chunks in order, holding the fp32 state
slice S [K, BV] in registers::

    V' = U - W S                       [C, BV]   (the delta-rule corrected values)
    O  = QG S + Aqk V'                 [C, BV]   (written in o's dtype)
    S  = diag(GL) S + KD^T V'          [K, BV]

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


@triton.jit
def chunk_state_kernel(
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, glast_ptr,  # outputs of phases 1-3 (see prefill.py)
    cu_seqlens_ptr, seq_first_chunk_ptr,  # int32 [N+1] each
    state_ptr, state_indices_ptr, has_init_ptr,  # fp32 [S, H, K, V]; int32 [N]; int8 [N]
    o_ptr, inter_ptr, inter_map_ptr,  # o [T, H, V]; fp32 [M, H, K, V]; int32 [NC] (read when HAS_INTER)
    hbuf_ptr, vbuf_ptr,  # without WITH_OUTPUT: chunk-start states [NC, H, K, V] and V' [T, H, V]
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    HAS_INTER: tl.constexpr, WITH_OUTPUT: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
):
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
        m = (rt < eos - t0)[:, None]
        s_dot = s.to(DOT_T)
        w = tl.load(w_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
        u = tl.load(u_ptr + t0 * (H * V) + loc_v, mask=m, other=0.0).to(tl.float32)
        v_new = u - tl.dot(w, s_dot, input_precision=PREC)  # [BT, BV]
        v_dot = v_new.to(DOT_T)
        if WITH_OUTPUT:
            qg = tl.load(qg_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
            aqk = tl.load(aqk_ptr + t0 * (H * BT) + loc_a, mask=m, other=0.0).to(DOT_T)  # [BT, BT]
            o = tl.dot(qg, s_dot, input_precision=PREC) + tl.dot(aqk, v_dot, input_precision=PREC)
            tl.store(o_ptr + t0 * (H * V) + loc_v, o.to(o_ptr.dtype.element_ty), mask=m)
        else:
            h_c = hbuf_ptr + ((c_first + ci) * H + h).to(tl.int64) * (K * V)
            tl.store(h_c + s_offs, s_dot.to(hbuf_ptr.dtype.element_ty))
            tl.store(vbuf_ptr + t0 * (H * V) + loc_v, v_dot.to(vbuf_ptr.dtype.element_ty), mask=m)
        kd = tl.load(kd_ptr + t0 * (H * K) + loc_k, mask=m, other=0.0).to(DOT_T)
        gl = tl.load(glast_ptr + ((c_first + ci) * H + h).to(tl.int64) * K + rk)  # [K]
        s = s * gl[:, None] + tl.dot(tl.trans(kd), v_dot, input_precision=PREC)
        if HAS_INTER:
            row = tl.load(inter_map_ptr + c_first + ci)
            if row >= 0:
                tl.store(inter_ptr + (row.to(tl.int64) * H + h) * (K * V) + s_offs, s)
    tl.store(state_h + s_offs, s)
