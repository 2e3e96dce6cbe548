"""Phase 3 of the chunked FlyDSL KDA prefill (the Triton twin's phase 4): the inter-chunk state walk with the
WY solve inside it and the output, one wave per (value tile of 16 columns, sequence, head), the chunk products on
fp32 MFMA (``v_mfma_f32_16x16x4_f32``).

Twin of ``rocm_k3.triton_kernels.kda.chunk_state`` with ``SOLVE_IN`` and the output fused (``WITH_OUTPUT``), the
Triton default since session 19 (``prefill.SOLVE_IN_WALK``). Walking the sequence's chunks in order with the fp32
state slice S [K, 16] in registers, for the n <= 64 rows of a chunk (G and b from phase 1; the A band, KB, Aqk and the
row operands QG = q' exp(G), KD = k' exp(G_last - G) from phase 2; G_last = G at the chunk's last row), by
associativity V' = U - W S = (I + A)^-1 (b v - KB S), solved by block forward substitution over the chunk's four
16-row tiles I in order::

    V'_I = T_II (b v_I - KB_I S - sum_{J < I} A_IJ V'_J)        [16, 16] per tile  (T_II = (I + A_II)^-1)
    O    = QG S + Aqk V'                                        [n, 16]   (written in o's dtype)
    S    = diag(exp(G_last)) S + KD^T V'

The initial state is ``State[Slots[n]]`` when ``HasInit[n]`` (else 0, selected so a never-written slot's NaN
cannot leak in); the final state is written back to the same slot. ``InterMap[chunk]`` >= 0 asks for the state
after that chunk in row ``InterMap[chunk]`` of ``Inter``.

Tiling: 64 lanes. S is held as K/16 MFMA C fragments (16-row tiles, 4 fp32 per lane); contractions step through rows
in the order ``kda_prefill_plan.mfma_krow``, so those C fragments are used directly as the B operands of KB S and QG
S, and the C fragment of a tile's right-hand side is the B operand of its T_II product. V' is built one 16-row tile
per iteration and goes through LDS ([64, 16]), from where each lane reads the B operands of the later tiles' A_IJ
V'_J, of Aqk V' and of KD^T V' in the same step order (a barrier after each tile). The A operands (KB, the A band, QG,
Aqk, KD) are read from the fp32 intermediates, one value per lane and step (no exp in the MFMA loops; the only exps
left are exp(G_last) of the state's decay). Rows past the chunk's end read the chunk's last row (in range); their
right-hand side and their V' are set to 0, so they add nothing (T_II's upper triangle is stored as exact zeros, so a
valid row gives a later row's right-hand side zero weight); their outputs are not stored. All operands and
accumulators are fp32 (exact fp32 products, fp32 accumulation, as the reference). Row tiles, the substitution's
earlier tiles and the KD^T V' row groups are runtime loops, which keeps the register count near 200 (197 at K = 128).
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import CHUNK, STATE_BV, mfma_krow

MFMA_K = 4  # contraction depth of v_mfma_f32_16x16x4_f32
TILE = 16


def build_kda_chunk_state(config):
    """``launch(QG, KD, Gc, Ab, KB, V, B, Aqk, CuSeq, SeqFirstChunk, State, Slots, HasInit, O, Inter, InterMap,
    num_seqs)``.

    QG, KD fp32 [T, H, K] from phase 2, Gc fp32 [T, H, K] (only its chunks' last rows are read) and B fp32 [T, H] from
    phase 1; the A band Ab fp32 [T, H, 64] (T_II on its diagonal blocks), KB fp32 [T, H, K] and Aqk fp32 [T, H, 64]
    from phase 2; V [T, H, V] (activation dtype); CuSeq and SeqFirstChunk int32 [N+1]; State fp32 [S, H, K, V] (in
    place); Slots, HasInit int32 [N]; O [T, H, V] (activation dtype); Inter fp32 [M, H, K, V]; InterMap int32 [NC].
    ``config`` is a :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig`.
    """
    H, K = config.num_heads, config.head_dim
    k_tiles, k_steps = K // TILE, K // MFMA_K  # S row tiles; MFMA steps over K
    c_tiles, c_steps = CHUNK // TILE, CHUNK // MFMA_K  # chunk row tiles; MFMA steps over the chunk
    act = common.fx_dtype(config.dtype)

    def one(x):
        """A one-element fp32 MFMA operand fragment."""
        reg = fx.make_rmem_tensor(1, fx.Float32)
        reg.store(fx.Vector.from_elements([x], fx.Float32))
        return reg

    @fx.struct
    class Shared:
        vp: fx.Array[fx.Float32, CHUNK * STATE_BV, 16]  # V' of the chunk [64, 16]

    @flyc.kernel
    def kda_chunk_state_kernel(
        QG: fx.Tensor, KD: fx.Tensor, Gc: fx.Tensor, Ab: fx.Tensor, KB: fx.Tensor, V: fx.Tensor, B: fx.Tensor,
        Aqk: fx.Tensor, CuSeq: fx.Tensor, SeqFirstChunk: fx.Tensor, State: fx.Tensor, Slots: fx.Tensor,
        HasInit: fx.Tensor, O: fx.Tensor, Inter: fx.Tensor, InterMap: fx.Tensor,
    ):
        lane = gpu.thread_idx.x
        q = lane // TILE  # lane group: C rows 4q .. 4q+3 of a tile, contraction index group of a step
        a_row = lane % TILE  # A-operand row of a tile / C and B column
        vt = gpu.block_idx.x
        n = gpu.block_idx.y
        h = gpu.block_idx.z
        col = vt * STATE_BV + a_row  # value column of the head
        bos = fx.Int32(CuSeq[n])
        eos = fx.Int32(CuSeq[n + 1])
        first = fx.Int32(SeqFirstChunk[n])
        slot = fx.Int32(Slots[n])
        atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, MFMA_K, fx.Float32))
        svp = fx.SharedAllocator().allocate(Shared).peek().vp.view(fx.make_layout(CHUNK * STATE_BV, 1))

        has_init = fx.Int32(HasInit[n]) != 0
        st = []  # S tile m, element i: row 16 m + 4 q + i (= mfma_krow(4 m + i, q)), column col
        for m in range_constexpr(k_tiles):
            reg = fx.make_rmem_tensor(4, fx.Float32)
            reg.store(common.vector_of(
                [has_init.select(fx.Float32(State[slot, h, mfma_krow(4 * m + i, q), col]), 0.0)
                 for i in range_constexpr(4)], fx.Float32))
            st.append(reg)

        for ci in range(first, fx.Int32(SeqFirstChunk[n + 1])):
            t0 = bos + (ci - first) * CHUNK
            cnt = fx.min(eos - t0, CHUNK)  # rows in this chunk
            t_last = t0 + cnt - 1
            s_frag = [fx.memref_load_vec(st[m]) for m in range_constexpr(k_tiles)]

            # V'_I = T_II (b v_I - KB_I S - sum_{J < I} A_IJ V'_J), one 16-row tile I per iteration, into LDS
            # ([64, 16], row-major); the earlier tiles' V' rows are read back from LDS as B operands
            for r in range(c_tiles):
                src = fx.min(t0 + r * TILE + a_row, t_last)
                acc = common.fill_rmem(4, 0.0)  # KB_I S + sum_{J < I} A_IJ V'_J
                for s in range_constexpr(k_steps):
                    fx.gemm(atom, acc, one(fx.Float32(KB[src, h, mfma_krow(s, q)])), one(s_frag[s // 4][s % 4]), acc)
                for s in range(r * (TILE // MFMA_K)):  # the contraction over rows 0 .. 16 I - 1
                    j = mfma_krow(s, q)
                    fx.gemm(atom, acc, one(fx.Float32(Ab[src, h, j])), one(svp[j * STATE_BV + a_row]), acc)
                kbs = fx.memref_load_vec(acc)
                rhs = []  # C fragment of the tile's right-hand side = B operands of its T_II product
                for i in range_constexpr(4):
                    row = r * TILE + mfma_krow(i, q)  # chunk row of C element i
                    t = fx.min(t0 + row, t_last)
                    bv = fx.Float32(B[t, h]) * fx.Float32(V[t, h, col])
                    rhs.append((row < cnt).select(bv - kbs[i], 0.0))  # rows past the end: 0
                acc_v = common.fill_rmem(4, 0.0)
                for i in range_constexpr(4):
                    fx.gemm(atom, acc_v, one(fx.Float32(Ab[src, h, r * TILE + mfma_krow(i, q)])), one(rhs[i]), acc_v)
                vs = fx.memref_load_vec(acc_v)
                for i in range_constexpr(4):
                    row = r * TILE + mfma_krow(i, q)
                    svp[row * STATE_BV + a_row] = (row < cnt).select(vs[i], 0.0)
                gpu.barrier()  # the next tile reads this one's V' rows
            vp = [svp[mfma_krow(s, q) * STATE_BV + a_row] for s in range_constexpr(c_steps)]  # B operands over rows

            # O = QG S + Aqk V' (Aqk is zero above the diagonal), one 16-row tile per iteration
            for r in range(c_tiles):
                src = fx.min(t0 + r * TILE + a_row, t_last)
                acc_o = common.fill_rmem(4, 0.0)
                for s in range_constexpr(k_steps):
                    qg = fx.Float32(QG[src, h, mfma_krow(s, q)])
                    fx.gemm(atom, acc_o, one(qg), one(s_frag[s // 4][s % 4]), acc_o)
                for s in range_constexpr(c_steps):
                    fx.gemm(atom, acc_o, one(fx.Float32(Aqk[src, h, mfma_krow(s, q)])), one(vp[s]), acc_o)
                o = fx.memref_load_vec(acc_o)
                for i in range_constexpr(4):
                    row = r * TILE + mfma_krow(i, q)
                    if row < cnt:
                        O[t0 + row, h, col] = o[i].to(act)

            # S = diag(exp(G_last)) S + KD^T V'; the contraction over the chunk's rows
            # runs one 16-row group (4 MFMA steps) per iteration
            for m in range_constexpr(k_tiles):
                st[m].store(common.vector_of(
                    [s_frag[m][i] * fmath.exp(fx.Float32(Gc[t_last, h, mfma_krow(4 * m + i, q)]))
                     for i in range_constexpr(4)], fx.Float32))
            for rg in range(c_tiles):
                for i in range_constexpr(4):
                    j = rg * TILE + mfma_krow(i, q)  # = mfma_krow(4 rg + i, q): chunk row of this step
                    t = fx.min(t0 + j, t_last)
                    b = one(svp[j * STATE_BV + a_row])
                    for m in range_constexpr(k_tiles):
                        kd = fx.Float32(KD[t, h, m * TILE + a_row])  # A-operand row: a key channel
                        fx.gemm(atom, st[m], one(kd), b, st[m])
            gpu.barrier()  # every lane has read V' before the next chunk overwrites it

            irow = fx.Int32(InterMap[ci])
            if irow >= 0:
                for m in range_constexpr(k_tiles):
                    s_new = fx.memref_load_vec(st[m])
                    for i in range_constexpr(4):
                        Inter[irow, h, mfma_krow(4 * m + i, q), col] = s_new[i]

        for m in range_constexpr(k_tiles):
            s_new = fx.memref_load_vec(st[m])
            for i in range_constexpr(4):
                State[slot, h, mfma_krow(4 * m + i, q), col] = s_new[i]

    @flyc.jit
    def launch(
        QG: fx.Tensor, KD: fx.Tensor, Gc: fx.Tensor, Ab: fx.Tensor, KB: fx.Tensor, V: fx.Tensor, B: fx.Tensor,
        Aqk: fx.Tensor, CuSeq: fx.Tensor, SeqFirstChunk: fx.Tensor, State: fx.Tensor, Slots: fx.Tensor,
        HasInit: fx.Tensor, O: fx.Tensor, Inter: fx.Tensor, InterMap: fx.Tensor, num_seqs: fx.Int32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_chunk_state_kernel(QG, KD, Gc, Ab, KB, V, B, Aqk, CuSeq, SeqFirstChunk, State, Slots, HasInit, O, Inter,
                               InterMap).launch(grid=(K // STATE_BV, num_seqs, H), block=(common.WAVE,), stream=stream)

    return launch
