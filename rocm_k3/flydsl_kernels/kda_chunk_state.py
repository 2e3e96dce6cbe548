"""Phase 4 of the chunked FlyDSL KDA prefill: the inter-chunk state walk and the output, one workgroup per
(value tile of 16 columns, sequence, head).

Twin of ``rocm_k3.triton_kernels.kda.chunk_state`` (with the output fused, ``WITH_OUTPUT``). Walking the
sequence's chunks in order with the fp32 state slice S [K, 16] in registers, for the n <= 64 rows of a chunk
(G, q', k' from phase 1, W, U, Aqk from phases 2-3, G_last = G at the chunk's last row)::

    V' = U - W S                                   [n, 16]
    O  = (q' exp(G)) S + Aqk V'                    [n, 16]   (written in o's dtype)
    S  = diag(exp(G_last)) S + (k' exp(G_last - G))^T V'

The initial state is ``State[Slots[n]]`` when ``HasInit[n]`` (else 0, selected so a never-written slot's NaN
cannot leak in); the final state is written back to the same slot. ``InterMap[chunk]`` >= 0 asks for the state
after that chunk in row ``InterMap[chunk]`` of ``Inter``.

Tiling (VALU; no MFMA): 256 lanes, ``kda_prefill_plan.state_lane``: lane (v, kg) holds rows kg*K/16 .. of
column v; the 16 lanes of a column are adjacent, so the sums over K (W S and QG S, one row at a time) are
16-lane xor shuffles. V' and the state part of O go through LDS ([64, 16] each); then lane (v, kg) finishes
O for chunk rows kg*4 .. kg*4+3 (``state_out_row``) and the state update for its own rows.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import (
    CHUNK,
    LANES,
    STATE_BV,
    STATE_KGROUPS,
    STATE_OUT_ROWS,
    state_lane,
    state_out_row,
    state_row,
)


def build_kda_chunk_state(config):
    """``launch(Qn, Kn, Gc, WU, Aqk, CuSeq, SeqFirstChunk, State, Slots, HasInit, O, Inter, InterMap, num_seqs)``.

    Qn, Kn, Gc fp32 [T, H, K]; WU fp32 [T, H, K + V]; Aqk fp32 [T, H, 64]; CuSeq and SeqFirstChunk int32 [N+1];
    State fp32 [S, H, K, V] (in place); Slots, HasInit int32 [N]; O [T, H, V] (activation dtype); Inter fp32
    [M, H, K, V]; InterMap int32 [NC]. ``config`` is a :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig`.
    """
    H, K = config.num_heads, config.head_dim
    rows = K // STATE_KGROUPS  # state rows per lane
    act = common.fx_dtype(config.dtype)

    @fx.struct
    class Shared:
        vp: fx.Array[fx.Float32, CHUNK * STATE_BV, 16]  # V' [64, 16]
        os: fx.Array[fx.Float32, CHUNK * STATE_BV, 16]  # (q' exp(G)) S [64, 16]

    @flyc.kernel
    def kda_chunk_state_kernel(
        Qn: fx.Tensor, Kn: fx.Tensor, Gc: fx.Tensor, WU: fx.Tensor, Aqk: fx.Tensor, CuSeq: fx.Tensor,
        SeqFirstChunk: fx.Tensor, State: fx.Tensor, Slots: fx.Tensor, HasInit: fx.Tensor, O: fx.Tensor,
        Inter: fx.Tensor, InterMap: fx.Tensor,
    ):
        tid = gpu.thread_idx.x
        v, kg = state_lane(tid)
        lead = kg == 0
        vt = gpu.block_idx.x
        n = gpu.block_idx.y
        h = gpu.block_idx.z
        col = vt * STATE_BV + v  # value column of the head
        bos = fx.Int32(CuSeq[n])
        eos = fx.Int32(CuSeq[n + 1])
        first = fx.Int32(SeqFirstChunk[n])
        slot = fx.Int32(Slots[n])
        lds = fx.SharedAllocator().allocate(Shared).peek()
        svp = lds.vp.view(fx.make_layout(CHUNK * STATE_BV, 1))
        sos = lds.os.view(fx.make_layout(CHUNK * STATE_BV, 1))

        has_init = fx.Int32(HasInit[n]) != 0
        st = fx.make_rmem_tensor(rows, fx.Float32)
        st.store(common.vector_of(
            [has_init.select(fx.Float32(State[slot, h, state_row(kg, i, K), col]), 0.0) for i in range_constexpr(rows)],
            fx.Float32))

        for ci in range(first, fx.Int32(SeqFirstChunk[n + 1])):
            t0 = bos + (ci - first) * CHUNK
            cnt = fx.min(eos - t0, CHUNK)  # rows in this chunk
            s = fx.memref_load_vec(st)
            # V' and (q' exp(G)) S, one row at a time, summed over the 16 lanes of the column
            for t in range(t0, t0 + cnt):
                pw = fx.Float32(0.0)
                po = fx.Float32(0.0)
                for i in range_constexpr(rows):
                    k_r = state_row(kg, i, K)
                    pw = pw + fx.Float32(WU[t, h, k_r]) * s[i]
                    po = po + fx.Float32(Qn[t, h, k_r]) * fmath.exp(fx.Float32(Gc[t, h, k_r])) * s[i]
                pw = common.group_sum(pw, STATE_KGROUPS)
                po = common.group_sum(po, STATE_KGROUPS)
                if lead:
                    svp[(t - t0) * STATE_BV + v] = fx.Float32(WU[t, h, K + col]) - pw
                    sos[(t - t0) * STATE_BV + v] = po
            gpu.barrier()

            # O rows kg*4 .. kg*4+3 of column v: (q' exp(G)) S + Aqk V' (Aqk is zero above the diagonal)
            acc = common.fill_rmem(STATE_OUT_ROWS, 0.0)
            for j in range(cnt):
                a = fx.memref_load_vec(acc)
                vpj = svp[j * STATE_BV + v]
                new = []
                for r in range_constexpr(STATE_OUT_ROWS):
                    src = fx.min(t0 + state_out_row(kg, r), t0 + cnt - 1)  # rows past the chunk: not stored
                    new.append(a[r] + fx.Float32(Aqk[src, h, j]) * vpj)
                acc.store(common.vector_of(new, fx.Float32))
            a = fx.memref_load_vec(acc)
            for r in range_constexpr(STATE_OUT_ROWS):
                orow = state_out_row(kg, r)
                if orow < cnt:
                    O[t0 + orow, h, col] = (a[r] + sos[orow * STATE_BV + v]).to(act)

            # S = diag(exp(G_last)) S + sum_t (k'_t exp(G_last - G_t)) V'_t
            gl = [fx.Float32(Gc[t0 + cnt - 1, h, state_row(kg, i, K)]) for i in range_constexpr(rows)]
            st.store(common.vector_of([s[i] * fmath.exp(gl[i]) for i in range_constexpr(rows)], fx.Float32))
            for t in range(t0, t0 + cnt):
                s = fx.memref_load_vec(st)
                vpt = svp[(t - t0) * STATE_BV + v]
                new = []
                for i in range_constexpr(rows):
                    k_r = state_row(kg, i, K)
                    kd = fx.Float32(Kn[t, h, k_r]) * fmath.exp(gl[i] - fx.Float32(Gc[t, h, k_r]))
                    new.append(s[i] + kd * vpt)
                st.store(common.vector_of(new, fx.Float32))
            gpu.barrier()  # V' and the O part are read by every lane before the next chunk overwrites them

            irow = fx.Int32(InterMap[ci])
            if irow >= 0:
                s = fx.memref_load_vec(st)
                for i in range_constexpr(rows):
                    Inter[irow, h, state_row(kg, i, K), col] = s[i]

        s = fx.memref_load_vec(st)
        for i in range_constexpr(rows):
            State[slot, h, state_row(kg, i, K), col] = s[i]

    @flyc.jit
    def launch(
        Qn: fx.Tensor, Kn: fx.Tensor, Gc: fx.Tensor, WU: fx.Tensor, Aqk: fx.Tensor, CuSeq: fx.Tensor,
        SeqFirstChunk: fx.Tensor, State: fx.Tensor, Slots: fx.Tensor, HasInit: fx.Tensor, O: fx.Tensor,
        Inter: fx.Tensor, InterMap: fx.Tensor, num_seqs: fx.Int32, stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_chunk_state_kernel(Qn, Kn, Gc, WU, Aqk, CuSeq, SeqFirstChunk, State, Slots, HasInit, O, Inter,
                               InterMap).launch(grid=(K // STATE_BV, num_seqs, H), block=(LANES,), stream=stream)

    return launch
