"""Phase 2 of the chunked FlyDSL KDA prefill: in-chunk pair matrices, the diagonal blocks' inverses and the walk's
row operands KB, QG, KD, one workgroup per (chunk, head).

Twin of ``rocm_k3.triton_kernels.kda.chunk_intra`` with ``INVERT_DIAG``, ``WRITE_KB`` and ``RAW_QK`` (the Triton
default since session 21: ``prefill.SOLVE_IN_WALK``, the WY solve inside the state walk, :mod:`.kda_chunk_state`;
``prefill.NORMS_IN_INTRA``, q and k normalised here). With G and b from phase 1 (:mod:`.kda_chunk_prep`), the raw q,
k and the n <= 64 rows of the chunk, k' = rk k and q' = rq q (rk = 1 / ||k||, rq = scale / ||q||; 1 and scale
without the L2 norm)::

    A[i, j]   = b_i rk_i rk_j sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])     j <  i   (strictly lower), fp32
    Aqk[i, j] =     rq_i rk_j sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])     j <= i   written [T, H, 64]
    A band    = A off the four 16 x 16 diagonal blocks (zero above them), T_II = (I + A_II)^-1 on them
                                                                              written [T, H, 64]
    KB = b exp(G) k',  QG = q' exp(G),  KD = k' exp(G_last - G)             written [T, H, K]

computed in fp32 and written in the state walk's MFMA operand type (``kda_prefill_plan.walk_operands``): bf16 for
bf16 activations (one rounding, where the Triton twin rounds its dot operands), fp32 otherwise.

Numerics: every decay factor is computed as ``exp(G_i - G_j)`` from the fp32 difference, never split into
``exp(G_i) * exp(-G_j)`` (the Triton twin's 16-row sub-block reference rows exist only to feed tensor-core dots), so
no gate range limit applies here. The row factors factor out of the pair sums: the sums run over the raw q, k and
the factors multiply the results (the Triton twin normalises the rows before its dots; same values, another fp32
rounding order).

Tiling (VALU; no MFMA): 256 lanes. Pair matrices: lane ``tid`` owns row i and the 16 columns of one 16-column block
(``kda_prefill_plan.intra_pair``); the chunk's raw k, q and G are staged through LDS in [64, 32] slabs
(``intra_slab``), the 16 + 16 fp32 accumulators and the row's two sums of squares stay in registers; the lanes with
``tid % 4 == 0`` put their row's factors rk_i, rq_i in LDS ([2, 64]) for the column factors rk_j. A goes to LDS (64 x
64 fp32), Aqk to global; each lane writes its row's A band entries off the diagonal blocks. Inverses: lanes 0..63,
one per (diagonal block, column c) (``kda_prefill_plan.intra_inverse``), solve (I + A_II) t = e_c by forward
substitution over the block's 16 rows read from LDS (uniform addresses within a 16-lane group), the solved entries
kept in registers: 120 FMAs per lane. This is the row-by-row inversion, not the Triton twin's product of four
factors: here the product form would cost six 16 x 16 x 16 products on VALU (24 576 FMAs per block) where the
substitution costs 1 920, and it runs beside the pair matrices in the same workgroup, so its short dependent chain is
no launch of its own. Same (I + A_II)^-1, a different fp32 summation order. KB, QG, KD: the chunk's 64 x K elements,
K / 4 per lane.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import (
    CHUNK,
    INTRA_COLS,
    INTRA_SLAB,
    LANES,
    SUB,
    intra_inverse,
    intra_pair,
    intra_slab,
    intra_slab_elems,
    walk_operands,
)


def build_kda_chunk_intra(config):
    """``launch(Q, Kt, Gc, B, ChunkSeq, ChunkStart, CuSeq, Aqk, Ab, KB, QG, KD, num_chunks, scale)``.

    Q, Kt [T, H, K] the raw q, k (activation dtype, contiguous); Gc fp32 [T, H, K] and B fp32 [T, H] from phase 1;
    the chunk plan as in :mod:`.kda_chunk_prep`; outputs Aqk [T, H, 64] (zeros above the diagonal), the A band
    Ab [T, H, 64] (T_II on the diagonal blocks, zeros above them), KB, QG and KD [T, H, K], all in the walk's
    operand type (``walk_operands(config.dtype)``: bf16 or fp32). ``config`` is
    a :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig` (K = V).
    """
    H, K = config.num_heads, config.head_dim
    slabs = K // INTRA_SLAB
    elems = intra_slab_elems()
    kb_elems = CHUNK * K // LANES  # KB / QG / KD elements per lane
    row_lanes = LANES // CHUNK  # lanes sharing a row of the pair matrices
    opnd = common.fx_dtype(walk_operands(config.dtype))  # type of the written intermediates (the walk's operands)

    @fx.struct
    class Shared:
        buf: fx.Array[fx.Float32, 3 * CHUNK * INTRA_SLAB, 16]  # raw k, raw q, G slabs
        a: fx.Array[fx.Float32, CHUNK * CHUNK, 16]
        rn: fx.Array[fx.Float32, 2 * CHUNK, 16]  # row factors: 1 / ||k_i|| at i, scale / ||q_i|| at 64 + i

    @flyc.kernel
    def kda_chunk_intra_kernel(
        Q: fx.Tensor, Kt: fx.Tensor, Gc: fx.Tensor, B: fx.Tensor, ChunkSeq: fx.Tensor, ChunkStart: fx.Tensor,
        CuSeq: fx.Tensor, Aqk: fx.Tensor, Ab: fx.Tensor, KB: fx.Tensor, QG: fx.Tensor, KD: fx.Tensor,
        scale: fx.Float32,
    ):
        tid = gpu.thread_idx.x
        ch = gpu.block_idx.x
        h = gpu.block_idx.y
        t0 = fx.Int32(ChunkStart[ch])
        t_end = fx.min(fx.Int32(CuSeq[fx.Int32(ChunkSeq[ch]) + 1]), t0 + CHUNK)
        t_last = t_end - 1
        lds = fx.SharedAllocator().allocate(Shared).peek()
        slab = CHUNK * INTRA_SLAB
        sb = lds.buf.view(fx.make_layout(3 * slab, 1))  # k slab at 0, q slab at `slab`, G at 2 * slab
        sa = lds.a.view(fx.make_layout(CHUNK * CHUNK, 1))
        srn = lds.rn.view(fx.make_layout(2 * CHUNK, 1))

        i, j0 = intra_pair(tid, 0)
        acc_k = common.fill_rmem(INTRA_COLS, 0.0)  # sum_d k_i k_j exp(G_i - G_j) (raw k), columns j of the lane
        acc_q = common.fill_rmem(INTRA_COLS, 0.0)  # the same with the raw q_i
        sq = common.fill_rmem(2, 0.0)  # sum_d k_i^2, sum_d q_i^2 of the lane's row
        for s in range_constexpr(slabs):
            for e in range_constexpr(elems):
                row, d = intra_slab(tid, e)
                src = fx.min(t0 + row, t_last)
                sb[row * INTRA_SLAB + d] = fx.Float32(Kt[src, h, s * INTRA_SLAB + d])
                sb[slab + row * INTRA_SLAB + d] = fx.Float32(Q[src, h, s * INTRA_SLAB + d])
                sb[2 * slab + row * INTRA_SLAB + d] = fx.Float32(Gc[src, h, s * INTRA_SLAB + d])
            gpu.barrier()
            for d in range(INTRA_SLAB):
                k_i, q_i, g_i = sb[i * INTRA_SLAB + d], sb[slab + i * INTRA_SLAB + d], sb[2 * slab + i * INTRA_SLAB + d]
                ak, aq, ss = fx.memref_load_vec(acc_k), fx.memref_load_vec(acc_q), fx.memref_load_vec(sq)
                nk, nq = [], []
                for r in range_constexpr(INTRA_COLS):
                    _, j = intra_pair(tid, r)
                    # exp of the fp32 difference; j > i may overflow, those entries are discarded below
                    kj = fmath.exp(g_i - sb[2 * slab + j * INTRA_SLAB + d]) * sb[j * INTRA_SLAB + d]
                    nk.append(ak[r] + k_i * kj)
                    nq.append(aq[r] + q_i * kj)
                acc_k.store(common.vector_of(nk, fx.Float32))
                acc_q.store(common.vector_of(nq, fx.Float32))
                sq.store(common.vector_of([ss[0] + k_i * k_i, ss[1] + q_i * q_i], fx.Float32))
            gpu.barrier()  # every lane has read the slab before the next one overwrites it

        # the row factors (the L2 norms factor out of the pair sums): k'_i = rk_i k_i, q'_i = rq_i q_i
        ss = fx.memref_load_vec(sq)
        rk_i, rq_i = fx.Float32(1.0), scale
        if const_expr(config.qk_l2norm):
            rk_i = fmath.rsqrt(ss[0] + 1e-6)
            rq_i = fmath.rsqrt(ss[1] + 1e-6) * scale
        if tid % row_lanes == 0:
            srn[i] = rk_i
            srn[CHUNK + i] = rq_i
        gpu.barrier()

        b_i = fx.Float32(B[fx.min(t0 + i, t_last), h])
        ak, aq = fx.memref_load_vec(acc_k), fx.memref_load_vec(acc_q)
        a_row, qk_row = [], []
        for r in range_constexpr(INTRA_COLS):
            _, j = intra_pair(tid, r)
            rk_j = srn[j]
            a_ij = (j < i).select(ak[r] * (b_i * rk_i) * rk_j, 0.0)
            sa[i * CHUNK + j] = a_ij
            a_row.append(a_ij)
            qk_row.append((j <= i).select(aq[r] * rq_i * rk_j, 0.0))
        if t0 + i < t_end:
            for r in range_constexpr(INTRA_COLS):
                _, j = intra_pair(tid, r)
                Aqk[t0 + i, h, j] = qk_row[r].to(opnd)
            # the A band off the diagonal blocks: the lane's 16 columns are one 16-column block (j0 // SUB)
            if j0 // SUB != i // SUB:
                for r in range_constexpr(INTRA_COLS):
                    _, j = intra_pair(tid, r)
                    Ab[t0 + i, h, j] = a_row[r].to(opnd)  # zero above the diagonal blocks (j > i there)
        gpu.barrier()

        # the diagonal blocks' inverses: lane (block, c) solves (I + A_II) t = e_c down the block's rows
        if tid < CHUNK:
            blk, c = intra_inverse(tid)
            base = blk * SUB
            t = []
            for r in range_constexpr(SUB):
                acc = (c == r).select(fx.Float32(1.0), fx.Float32(0.0))
                for jj in range_constexpr(r):
                    acc = acc - sa[(base + r) * CHUNK + base + jj] * t[jj]
                t.append(acc)
            for r in range_constexpr(SUB):
                if t0 + base + r < t_end:
                    Ab[t0 + base + r, h, base + c] = t[r].to(opnd)

        # the walk's row operands: KB = b exp(G) k' (the right-hand side in W's place), QG = q' exp(G),
        # KD = k' exp(G_last - G) (G_last: G at the chunk's last row)
        for e in range_constexpr(kb_elems):
            idx = tid + e * LANES
            row = idx // K
            d = idx % K
            if t0 + row < t_end:
                st = t0 + row
                g = fx.Float32(Gc[st, h, d])
                eg = fmath.exp(g)
                k = fx.Float32(Kt[st, h, d]) * srn[row]
                KB[st, h, d] = (k * eg * fx.Float32(B[st, h])).to(opnd)
                QG[st, h, d] = (fx.Float32(Q[st, h, d]) * srn[CHUNK + row] * eg).to(opnd)
                KD[st, h, d] = (k * fmath.exp(fx.Float32(Gc[t_last, h, d]) - g)).to(opnd)

    @flyc.jit
    def launch(
        Q: fx.Tensor, Kt: fx.Tensor, Gc: fx.Tensor, B: fx.Tensor, ChunkSeq: fx.Tensor, ChunkStart: fx.Tensor,
        CuSeq: fx.Tensor, Aqk: fx.Tensor, Ab: fx.Tensor, KB: fx.Tensor, QG: fx.Tensor, KD: fx.Tensor,
        num_chunks: fx.Int32, scale: fx.Float32, stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_chunk_intra_kernel(Q, Kt, Gc, B, ChunkSeq, ChunkStart, CuSeq, Aqk, Ab, KB, QG, KD, scale).launch(
            grid=(num_chunks, H), block=(LANES,), stream=stream)

    return launch
