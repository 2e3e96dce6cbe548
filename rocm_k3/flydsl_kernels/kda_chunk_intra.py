"""Phases 2 + 3 of the chunked FlyDSL KDA prefill: in-chunk pair matrices and the WY solve, one workgroup per
(chunk, head).

Twin of ``rocm_k3.triton_kernels.kda.chunk_intra`` + ``chunk_solve``. With G, q', k', b from phase 1
(:mod:`.kda_chunk_prep`) and the n <= 64 rows of the chunk::

    A[i, j]   = b_i * sum_d k'_i[d] k'_j[d] exp(G_i[d] - G_j[d])     j <  i   (strictly lower), fp32
    Aqk[i, j] =       sum_d q'_i[d] k'_j[d] exp(G_i[d] - G_j[d])     j <= i   written fp32 [T, H, 64]
    (I + A) W = b * exp(G) * k'     [n, K]        (I + A) U = b * v     [n, V]

W and U are written side by side as WU fp32 [T, H, K + V]. Numerics: every decay factor is computed as
``exp(G_i - G_j)`` from the fp32 difference, never split into ``exp(G_i) * exp(-G_j)`` (the Triton twin's
16-row sub-block reference rows exist only to feed tensor-core dots), so no gate range limit applies here.

Tiling (VALU; no MFMA): 256 lanes. Pair matrices: lane ``tid`` owns row i and 16 columns
(``kda_prefill_plan.intra_pair``); the chunk's k', q', G are staged through LDS in [64, 32] slabs
(``intra_slab``), the 16 + 16 fp32 accumulators stay in registers. A goes to LDS (64 x 64 fp32), Aqk to global.
Solve: in passes of 128 columns of [X | Y] (X = b exp(G) k', Y = b v), lane ``tid`` < 128 owns one column
and runs the forward substitution ``w_i = x_i - sum_{j<i} A[i, j] w_j`` over the chunk's rows, its solved
rows kept in LDS (the slab space) and the A rows read from LDS (uniform addresses, broadcast); the sum over j
runs as four interleaved partial sums (independent FMA chains). This is the block forward substitution of the
Triton twin with 1 x 1 blocks: the same (I + A)^-1, a different fp32 summation order.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import (
    CHUNK,
    INTRA_COLS,
    INTRA_SLAB,
    LANES,
    SOLVE_COLS,
    intra_pair,
    intra_slab,
    intra_slab_elems,
)


def build_kda_chunk_intra(config):
    """``launch(Qn, Kn, Gc, B, V, ChunkSeq, ChunkStart, CuSeq, Aqk, WU, num_chunks)``.

    Qn, Kn, Gc fp32 [T, H, K] and B fp32 [T, H] from phase 1; V [T, H, V] (activation dtype); the chunk plan
    as in :mod:`.kda_chunk_prep`; outputs Aqk fp32 [T, H, 64] (zeros above the diagonal) and WU fp32
    [T, H, K + V]. ``config`` is a :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig` (K = V).
    """
    H, K = config.num_heads, config.head_dim
    cols = 2 * K  # [W | U] columns (V = K)
    if cols > LANES:
        raise ValueError(f"head_dim {K}: the solve needs 2K <= {LANES} lanes")
    slabs = K // INTRA_SLAB
    pass_cols = min(cols, SOLVE_COLS)
    passes = cols // pass_cols
    buf_elems = max(3 * CHUNK * INTRA_SLAB, CHUNK * pass_cols)
    elems = intra_slab_elems()

    @fx.struct
    class Shared:
        buf: fx.Array[fx.Float32, buf_elems, 16]  # k', q', G slabs; then the solved rows
        a: fx.Array[fx.Float32, CHUNK * CHUNK, 16]

    @flyc.kernel
    def kda_chunk_intra_kernel(
        Qn: fx.Tensor, Kn: fx.Tensor, Gc: fx.Tensor, B: fx.Tensor, V: fx.Tensor, ChunkSeq: fx.Tensor,
        ChunkStart: fx.Tensor, CuSeq: fx.Tensor, Aqk: fx.Tensor, WU: fx.Tensor,
    ):
        tid = gpu.thread_idx.x
        ch = gpu.block_idx.x
        h = gpu.block_idx.y
        t0 = fx.Int32(ChunkStart[ch])
        t_end = fx.min(fx.Int32(CuSeq[fx.Int32(ChunkSeq[ch]) + 1]), t0 + CHUNK)
        t_last = t_end - 1
        lds = fx.SharedAllocator().allocate(Shared).peek()
        slab = CHUNK * INTRA_SLAB
        sb = lds.buf.view(fx.make_layout(buf_elems, 1))  # k' slab at 0, q' slab at `slab`, G at 2 * slab
        sa = lds.a.view(fx.make_layout(CHUNK * CHUNK, 1))

        i, _ = intra_pair(tid, 0)
        acc_k = common.fill_rmem(INTRA_COLS, 0.0)  # sum_d k'_i k'_j exp(G_i - G_j), columns j of the lane
        acc_q = common.fill_rmem(INTRA_COLS, 0.0)  # the same with q'_i
        for s in range_constexpr(slabs):
            for e in range_constexpr(elems):
                row, d = intra_slab(tid, e)
                src = fx.min(t0 + row, t_last)
                sb[row * INTRA_SLAB + d] = fx.Float32(Kn[src, h, s * INTRA_SLAB + d])
                sb[slab + row * INTRA_SLAB + d] = fx.Float32(Qn[src, h, s * INTRA_SLAB + d])
                sb[2 * slab + row * INTRA_SLAB + d] = fx.Float32(Gc[src, h, s * INTRA_SLAB + d])
            gpu.barrier()
            for d in range(INTRA_SLAB):
                k_i, q_i, g_i = sb[i * INTRA_SLAB + d], sb[slab + i * INTRA_SLAB + d], sb[2 * slab + i * INTRA_SLAB + d]
                ak, aq = fx.memref_load_vec(acc_k), fx.memref_load_vec(acc_q)
                nk, nq = [], []
                for r in range_constexpr(INTRA_COLS):
                    _, j = intra_pair(tid, r)
                    # exp of the fp32 difference; j > i may overflow, those entries are discarded below
                    kj = fmath.exp(g_i - sb[2 * slab + j * INTRA_SLAB + d]) * sb[j * INTRA_SLAB + d]
                    nk.append(ak[r] + k_i * kj)
                    nq.append(aq[r] + q_i * kj)
                acc_k.store(common.vector_of(nk, fx.Float32))
                acc_q.store(common.vector_of(nq, fx.Float32))
            gpu.barrier()  # every lane has read the slab before the next one overwrites it

        b_i = fx.Float32(B[fx.min(t0 + i, t_last), h])
        ak, aq = fx.memref_load_vec(acc_k), fx.memref_load_vec(acc_q)
        qk_row = []
        for r in range_constexpr(INTRA_COLS):
            _, j = intra_pair(tid, r)
            sa[i * CHUNK + j] = (j < i).select(ak[r] * b_i, 0.0)
            qk_row.append((j <= i).select(aq[r], 0.0))
        if t0 + i < t_end:
            for r in range_constexpr(INTRA_COLS):
                _, j = intra_pair(tid, r)
                Aqk[t0 + i, h, j] = qk_row[r]
        gpu.barrier()

        # solve, in passes of SOLVE_COLS columns of [X | Y]: lane tid < SOLVE_COLS owns column
        # pass * SOLVE_COLS + tid and keeps its solved rows in LDS (the slab space, no longer read)
        for p in range_constexpr(passes):
            if tid < pass_cols:
                col = tid + p * pass_cols
                cc = col % K
                is_k = col < K
                for zr in range_constexpr(CHUNK):  # unsolved rows read as 0 (the 4-wide steps below overrun)
                    sb[zr * pass_cols + tid] = 0.0
                for srow in range(t_end - t0):
                    st = t0 + srow
                    skx = fx.Float32(Kn[st, h, cc]) * fmath.exp(fx.Float32(Gc[st, h, cc]))
                    sx = is_k.select(skx, fx.Float32(V[st, h, cc])) * fx.Float32(B[st, h])
                    # sum_{j < srow} A[srow, j] w_j as four interleaved partial sums, 4 j per step; j in
                    # [srow, 4 ceil(srow / 4)) adds A[srow, j] = 0 (strictly lower) times 0 (unsolved)
                    p0, p1, p2, p3 = fx.Float32(0.0), fx.Float32(0.0), fx.Float32(0.0), fx.Float32(0.0)
                    for sj in range((srow + 3) // 4):
                        jb = sj * 4
                        p0 = p0 + sa[srow * CHUNK + jb] * sb[jb * pass_cols + tid]
                        p1 = p1 + sa[srow * CHUNK + jb + 1] * sb[(jb + 1) * pass_cols + tid]
                        p2 = p2 + sa[srow * CHUNK + jb + 2] * sb[(jb + 2) * pass_cols + tid]
                        p3 = p3 + sa[srow * CHUNK + jb + 3] * sb[(jb + 3) * pass_cols + tid]
                    sx = sx - ((p0 + p1) + (p2 + p3))
                    sb[srow * pass_cols + tid] = sx  # [64, pass_cols] solved rows
                    WU[st, h, col] = sx

    @flyc.jit
    def launch(
        Qn: fx.Tensor, Kn: fx.Tensor, Gc: fx.Tensor, B: fx.Tensor, V: fx.Tensor, ChunkSeq: fx.Tensor,
        ChunkStart: fx.Tensor, CuSeq: fx.Tensor, Aqk: fx.Tensor, WU: fx.Tensor, num_chunks: fx.Int32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_chunk_intra_kernel(Qn, Kn, Gc, B, V, ChunkSeq, ChunkStart, CuSeq, Aqk, WU).launch(
            grid=(num_chunks, H), block=(LANES,), stream=stream)

    return launch
