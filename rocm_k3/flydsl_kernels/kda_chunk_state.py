"""Phase 3 of the chunked FlyDSL KDA prefill (the Triton twin's phase 4): the inter-chunk state walk with the
WY solve inside it and the output, one wave per (value tile of 16 columns, sequence, head), the chunk products on
MFMA: bf16 operands (``v_mfma_f32_16x16x16_bf16``, fp32 accumulation) for bf16 activations, as the Triton twin's
bf16 dots; fp32 operands (``v_mfma_f32_16x16x4_f32``) for fp16 / fp32 activations, as its fp32 dots.

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
in the order ``kda_prefill_plan.mfma_krow`` (kpl = ``state_kpl(dtype)`` values per lane and step: 4 at bf16, where C
tile m is B step m; 1 at fp32), so those C fragments are used directly as the B operands of KB S and QG S, and the C
fragment of a tile's right-hand side is the B operand of its T_II product. V' is built one 16-row tile per iteration
and goes through LDS ([64, 16], in the operand type), from where each lane reads the B operands of the later tiles'
A_IJ V'_J, of Aqk V' and of KD^T V' in the same step order (a barrier after each tile). The A operands (KB, the A
band, QG, Aqk, KD) are read from phase 2's intermediates, written in the operand type
(``kda_prefill_plan.walk_operands``), kpl values per lane and step (one 8-byte load at bf16 except KD^T's, which runs
down a column; no exp in the MFMA loops; the only exps left are exp(G_last) of the state's decay). Rows past the
chunk's end read the chunk's last row (in range); their right-hand side and their V' are set to 0, so they add nothing
(T_II's upper triangle is stored as exact zeros, so a valid row gives a later row's right-hand side zero weight);
their outputs are not stored. Accumulators are fp32. At bf16 the operands are rounded to bf16 where the Triton twin
rounds its dot operands (S before KB S and QG S, the right-hand side before T_II, V' once as it goes to LDS, the
intermediates as phase 2 writes them), so both twins carry the same bf16-level error against the fp32 reference; at
fp32 the products are exact fp32 as the reference's. Row tiles, the substitution's earlier tiles and the KD^T V' row
groups are runtime loops, which keeps the register count down (see the compile tier's budgets).
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import CHUNK, STATE_BV, mfma_krow, state_kpl, walk_operands

TILE = 16


def build_kda_chunk_state(config):
    """``launch(QG, KD, Gc, Ab, KB, V, B, Aqk, CuSeq, SeqFirstChunk, State, Slots, HasInit, O, Inter, InterMap,
    num_seqs)``.

    QG, KD [T, H, K] from phase 2, Gc fp32 [T, H, K] (only its chunks' last rows are read) and B fp32 [T, H] from
    phase 1; the A band Ab [T, H, 64] (T_II on its diagonal blocks), KB [T, H, K] and Aqk [T, H, 64] from phase 2
    (QG, KD, Ab, KB, Aqk in the operand type ``walk_operands(config.dtype)``: bf16 or fp32); V [T, H, V]
    (activation dtype); CuSeq and SeqFirstChunk int32 [N+1]; State fp32 [S, H, K, V] (in place); Slots, HasInit
    int32 [N]; O [T, H, V] (activation dtype); Inter fp32 [M, H, K, V]; InterMap int32 [NC].
    ``config`` is a :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig`.
    """
    H, K = config.num_heads, config.head_dim
    kpl = state_kpl(config.dtype)  # values per lane and MFMA step
    depth = 4 * kpl  # contraction depth of one MFMA step
    k_tiles, k_steps = K // TILE, K // depth  # S row tiles; MFMA steps over K
    c_tiles, c_steps, t_steps = CHUNK // TILE, CHUNK // depth, TILE // depth  # ... over the chunk; over one tile
    act = common.fx_dtype(config.dtype)
    elem = common.fx_dtype(walk_operands(config.dtype))  # MFMA operand type (bf16 at kpl 4, else fp32)

    def frag(values):
        """A kpl-element MFMA operand fragment of ``values`` already in the operand type (the intermediates, V')."""
        return common.rmem_of([elem(x) for x in values], elem)

    def cvt(x):
        """fp32 ``x`` in the operand type (rounded to bf16 at kpl > 1)."""
        return fx.Float32(x).to(elem) if kpl > 1 else fx.Float32(x)

    @fx.struct
    class Shared:
        vp: fx.Array[elem, CHUNK * STATE_BV, 16]  # V' of the chunk [64, 16], in the operand type

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
        atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, depth, elem))
        svp = fx.SharedAllocator().allocate(Shared).peek().vp.view(fx.make_layout(CHUNK * STATE_BV, 1))

        def krow(s, j):
            """Contraction index (a row of S, of the chunk or of a tile) of element j of MFMA step s."""
            return mfma_krow(s, q, j, kpl)

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
            # B operands of the contractions over K: element j of step s is C element e % 4 of S tile e // 4
            s_ops = [frag([cvt(s_frag[(s * kpl + j) // 4][(s * kpl + j) % 4]) for j in range_constexpr(kpl)])
                     for s in range_constexpr(k_steps)]

            # V'_I = T_II (b v_I - KB_I S - sum_{J < I} A_IJ V'_J), one 16-row tile I per iteration, into LDS
            # ([64, 16], row-major); the earlier tiles' V' rows are read back from LDS as B operands
            for r in range(c_tiles):
                src = fx.min(t0 + r * TILE + a_row, t_last)
                acc = common.fill_rmem(4, 0.0)  # KB_I S + sum_{J < I} A_IJ V'_J
                for s in range_constexpr(k_steps):
                    fx.gemm(atom, acc, frag([KB[src, h, krow(s, j)] for j in range_constexpr(kpl)]), s_ops[s], acc)
                for s in range(r * t_steps):  # the contraction over rows 0 .. 16 I - 1
                    fx.gemm(atom, acc, frag([Ab[src, h, krow(s, j)] for j in range_constexpr(kpl)]),
                            frag([svp[krow(s, j) * STATE_BV + a_row] for j in range_constexpr(kpl)]), acc)
                kbs = fx.memref_load_vec(acc)
                rhs = []  # C fragment of the tile's right-hand side = B operands of its T_II product
                for i in range_constexpr(4):
                    row = r * TILE + 4 * q + i  # chunk row of C element i
                    t = fx.min(t0 + row, t_last)
                    bv = fx.Float32(B[t, h]) * fx.Float32(V[t, h, col])
                    rhs.append((row < cnt).select(bv - kbs[i], 0.0))  # rows past the end: 0
                acc_v = common.fill_rmem(4, 0.0)
                for s in range_constexpr(t_steps):  # element j of step s: C element s kpl + j of the right-hand side
                    tii = frag([Ab[src, h, r * TILE + 4 * q + s * kpl + j] for j in range_constexpr(kpl)])
                    fx.gemm(atom, acc_v, tii, frag([cvt(rhs[s * kpl + j]) for j in range_constexpr(kpl)]), acc_v)
                vs = fx.memref_load_vec(acc_v)
                for i in range_constexpr(4):
                    row = r * TILE + 4 * q + i
                    svp[row * STATE_BV + a_row] = cvt((row < cnt).select(vs[i], 0.0))
                gpu.barrier()  # the next tile reads this one's V' rows
            vp = [frag([svp[krow(s, j) * STATE_BV + a_row] for j in range_constexpr(kpl)])
                  for s in range_constexpr(c_steps)]  # B operands over the chunk's rows

            # O = QG S + Aqk V' (Aqk is zero above the diagonal), one 16-row tile per iteration
            for r in range(c_tiles):
                src = fx.min(t0 + r * TILE + a_row, t_last)
                acc_o = common.fill_rmem(4, 0.0)
                for s in range_constexpr(k_steps):
                    fx.gemm(atom, acc_o, frag([QG[src, h, krow(s, j)] for j in range_constexpr(kpl)]), s_ops[s], acc_o)
                for s in range_constexpr(c_steps):
                    fx.gemm(atom, acc_o, frag([Aqk[src, h, krow(s, j)] for j in range_constexpr(kpl)]), vp[s], acc_o)
                o = fx.memref_load_vec(acc_o)
                for i in range_constexpr(4):
                    row = r * TILE + 4 * q + i
                    if row < cnt:
                        O[t0 + row, h, col] = o[i].to(act)

            # S = diag(exp(G_last)) S + KD^T V'; the contraction over the chunk's rows
            # runs one 16-row group (t_steps MFMA steps) per iteration
            for m in range_constexpr(k_tiles):
                st[m].store(common.vector_of(
                    [s_frag[m][i] * fmath.exp(fx.Float32(Gc[t_last, h, mfma_krow(4 * m + i, q)]))
                     for i in range_constexpr(4)], fx.Float32))
            for rg in range(c_tiles):
                for s0 in range_constexpr(t_steps):
                    s = rg * t_steps + s0
                    rows = [fx.min(t0 + krow(s, j), t_last) for j in range_constexpr(kpl)]  # chunk rows of step s
                    b = frag([svp[krow(s, j) * STATE_BV + a_row] for j in range_constexpr(kpl)])
                    for m in range_constexpr(k_tiles):  # A-operand row: key channel 16 m + a_row
                        fx.gemm(atom, st[m], frag([KD[rows[j], h, m * TILE + a_row] for j in range_constexpr(kpl)]),
                                b, st[m])
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
