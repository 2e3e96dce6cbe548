"""Phase 2 of the chunked FlyDSL KDA prefill: in-chunk pair matrices, the diagonal blocks' inverses and the walk's
row operands KB, QG, KD, one workgroup per (chunk, head).

Twin of ``rocm_k3.triton_kernels.kda.chunk_intra`` with ``INVERT_DIAG``, ``WRITE_KB`` and ``RAW_QK`` (the Triton
default since session 21: ``prefill.SOLVE_IN_WALK``, the WY solve inside the state walk, :mod:`.kda_chunk_state`;
``prefill.NORMS_IN_INTRA``, q and k normalised here). With G and b from phase 1 (:mod:`.kda_chunk_prep`), the raw q,
k and the n <= 64 rows of the chunk, k' = rk k and q' = rq q (rk = 1 / ||k||, rq = scale / ||q||; 1 and scale
without the L2 norm)::

    A[i, j]   = b_i rk_i rk_j sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])     j <  i   (strictly lower)
    Aqk[i, j] =     rq_i rk_j sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])     j <= i   written [T, H, 64]
    A band    = A off the four 16 x 16 diagonal blocks (zero above them), T_II = (I + A_II)^-1 on them
                                                                              written [T, H, 64]
    KB = b exp(G) k',  QG = q' exp(G),  KD = k' exp(G_last - G)             written [T, H, K]

written in the state walk's MFMA operand type (``kda_prefill_plan.walk_operands``): bf16 for bf16 activations (one
rounding, where the Triton twin rounds its dot operands), fp32 otherwise.

Pair sums on MFMA (since session 31; before, on VALU with one exp(G_i - G_j) per pair and channel): 16 x 16 tiles
(I, J) of 16-row blocks, J <= I, wave I of the four owning row block I (1 to 4 tiles each, ``kda_prefill_plan``'s
``intra_pair_dim`` for the channels), the products on ``v_mfma_f32_16x16x16_bf16`` for bf16 activations (operands
rounded to bf16, fp32 accumulation: the Triton twin's bf16 dots) or ``v_mfma_f32_16x16x4_f32`` otherwise: 10 tiles x
2 (k, q) x K / (4 kpl) MFMA per chunk and head (160 bf16 or 640 fp32 ones at K = 128). As in the Triton twin, every
decay factor is split at a reference R per channel, exp(G_i - G_j) = exp(G_i - R) exp(R - G_j), the first folded
into the row operand (q_i, k_i), the second into the column operand k_j. For the tiles of the earlier blocks (J < I)
R is G at block I's first row: both factors are <= 1 (G does not increase), so nothing overflows there at any decay
(a factor that underflows belongs to a product below fp32's range); the midpoint would do as well below the bound
below, the first row keeps these tiles finite above it. For the diagonal tile R is the midpoint of block I's G
range: both factors stay within 8 steps of decay of 1, so the operands stay inside fp32's (and bf16's) range while
half a block's G range plus ln max(|q|, |k|) stays below ~88, i.e. a token's |g| < 11 for inputs of moderate size
(K3's safe gate: |g| < 5), the Triton twin's bound (which it applies to the normalised q', k'). Past it the
diagonal tiles overflow to inf / NaN; nothing checks the gate's range at the boundary (a device reduction and a
synchronisation per call), as in the Triton twin. The entries above the diagonal may overflow below the bound too
and are discarded by selection. One exp per operand value instead of one per pair and channel (~37k for the pair
sums per chunk and head at K = 128, against 524k). The row factors (L2 norms) factor out of the pair sums: the sums
run over the raw q, k and the factors multiply the results, from the rows' sums of squares, which the lanes gather
as they load the A operands (a quarter of a row's channels per lane group, summed by two shuffles).

Tiling: 256 lanes, 4 waves. Wave I: lane l supplies row 16 I + l % 16 (A) and row 16 J + l % 16 (B) of every tile
(I, J), J <= I (tiles above, J > I, are skipped and written as zeros); C element c of tile J is the pair (16 I + 4 (l
// 16) + c, 16 J + l % 16). Rows past the chunk's end read its last row (in range) and are not written; a valid
row's columns past the end lie above the diagonal (masked to 0). The lanes of lane group 0 put their row's factors
rk_i, rq_i in LDS ([2, 64]); A goes to LDS (64 x 64 fp32) for the inverses, Aqk and the band's off-diagonal tiles to
global. Inverses: lanes 0..63, one per (diagonal block, column c) (``kda_prefill_plan.intra_inverse``), solve (I +
A_II) t = e_c by forward substitution over the block's 16 rows read from LDS (uniform addresses within a 16-lane
group), the solved entries kept in registers: 120 FMAs per lane. This is the row-by-row inversion, not the Triton
twin's product of four factors: on VALU the product form would cost six 16 x 16 x 16 products (24 576 FMAs per
block) where the substitution costs 1 920, and it runs beside the pair matrices in the same workgroup, so its
short dependent chain is no launch of its own. Same (I + A_II)^-1, a different fp32 summation order. KB, QG, KD:
the chunk's 64 x K elements, K / 4 per lane.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath
from flydsl.expr.typing import T

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import (
    CHUNK,
    LANES,
    SUB,
    intra_inverse,
    intra_pair_dim,
    state_kpl,
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
    kb_elems = CHUNK * K // LANES  # KB / QG / KD elements per lane
    opnd = common.fx_dtype(walk_operands(config.dtype))  # type of the written intermediates (the walk's operands)
    kpl = state_kpl(config.dtype)  # values per lane and MFMA step of the pair sums (the walk's operand type too)
    k_steps = K // (4 * kpl)
    blocks = CHUNK // SUB  # row blocks = waves

    def frag(values):
        """A kpl-element MFMA operand fragment of fp32 ``values`` in the operand type."""
        return common.rmem_of([x.to(opnd) if kpl > 1 else x for x in values], opnd)

    @fx.struct
    class Shared:
        a: fx.Array[fx.Float32, CHUNK * CHUNK, 16]  # A (strictly lower, times b and the norms), for the inverses
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
        sa = lds.a.view(fx.make_layout(CHUNK * CHUNK, 1))
        srn = lds.rn.view(fx.make_layout(2 * CHUNK, 1))

        # the pair sums on MFMA: wave I owns row block I and its tiles (I, J), J <= I. Every decay factor is split
        # at a reference R per channel, exp(G_i - G_j) = exp(G_i - R) exp(R - G_j): R = G at block I's first row for
        # the earlier blocks' tiles (both factors <= 1: no overflow at any decay), R = the midpoint of block I's G
        # range for its diagonal tile (both factors within 8 steps of decay of 1)
        blk = fx.Int32(fx.rocdl.readfirstlane(T.i32, tid // common.WAVE))  # the wave's row block, uniform (SGPR)
        lane = tid % common.WAVE
        q = lane // SUB  # lane group: C rows 4q .. 4q+3 of a tile, channel group of a step
        a_row = lane % SUB  # A / B operand row of a tile, C column
        i_src = fx.min(t0 + blk * SUB + a_row, t_last)  # this lane's A row (rows past the end read the last one)
        r_first = fx.min(t0 + blk * SUB, t_last)
        r_last = fx.min(t0 + blk * SUB + SUB - 1, t_last)
        atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 4 * kpl, opnd))
        acc_k = [common.fill_rmem(4, 0.0) for _ in range_constexpr(blocks)]  # sum_d k_i k_j e_ij (raw k), tile J
        acc_q = [common.fill_rmem(4, 0.0) for _ in range_constexpr(blocks)]  # the same with the raw q_i

        def column(J, dims, refs):
            """B fragment of tile (I, J): k_j exp(R - G_j) at the channels ``dims``, R = ``refs``."""
            j_src = fx.min(t0 + J * SUB + a_row, t_last)
            return frag([fx.Float32(Kt[j_src, h, d]) * fmath.exp(r - fx.Float32(Gc[j_src, h, d]))
                         for d, r in zip(dims, refs)])

        ssk = fx.Float32(0.0)  # sum_d k_i^2 over the lane's channels of its A row
        ssq = fx.Float32(0.0)
        for s in range_constexpr(k_steps):
            dims = [intra_pair_dim(s, q, j, kpl) for j in range_constexpr(kpl)]
            g_first = [fx.Float32(Gc[r_first, h, d]) for d in dims]
            g_mid = [(g + fx.Float32(Gc[r_last, h, d])) * 0.5 for g, d in zip(g_first, dims)]
            k_i = [fx.Float32(Kt[i_src, h, d]) for d in dims]
            q_i = [fx.Float32(Q[i_src, h, d]) for d in dims]
            g_i = [fx.Float32(Gc[i_src, h, d]) for d in dims]
            for j in range_constexpr(kpl):
                ssk = ssk + k_i[j] * k_i[j]
                ssq = ssq + q_i[j] * q_i[j]
            e_f = [fmath.exp(g - r) for g, r in zip(g_i, g_first)]
            e_m = [fmath.exp(g - r) for g, r in zip(g_i, g_mid)]
            a_kf, a_qf = frag([x * e for x, e in zip(k_i, e_f)]), frag([x * e for x, e in zip(q_i, e_f)])
            a_km, a_qm = frag([x * e for x, e in zip(k_i, e_m)]), frag([x * e for x, e in zip(q_i, e_m)])
            for J in range_constexpr(blocks):
                if J < blk:  # uniform in the wave; the tiles above the diagonal blocks are skipped (stay 0)
                    b = column(J, dims, g_first)
                    fx.gemm(atom, acc_k[J], a_kf, b, acc_k[J])
                    fx.gemm(atom, acc_q[J], a_qf, b, acc_q[J])
                if J == blk:
                    b = column(J, dims, g_mid)
                    fx.gemm(atom, acc_k[J], a_km, b, acc_k[J])
                    fx.gemm(atom, acc_q[J], a_qm, b, acc_q[J])

        # the row factors (the L2 norms factor out of the pair sums): k'_i = rk_i k_i, q'_i = rq_i q_i; the four lane
        # groups of a row hold a quarter of its channels each
        ssk = ssk + ssk.shuffle_xor(16, common.WAVE)
        ssk = ssk + ssk.shuffle_xor(32, common.WAVE)
        ssq = ssq + ssq.shuffle_xor(16, common.WAVE)
        ssq = ssq + ssq.shuffle_xor(32, common.WAVE)
        rk_a, rq_a = fx.Float32(1.0), scale
        if const_expr(config.qk_l2norm):
            rk_a = fmath.rsqrt(ssk + 1e-6)
            rq_a = fmath.rsqrt(ssq + 1e-6) * scale
        if q == 0:
            srn[blk * SUB + a_row] = rk_a
            srn[CHUNK + blk * SUB + a_row] = rq_a
        gpu.barrier()

        # C element c of tile J: pair (i, j) = (16 I + 4 q + c, 16 J + a_row); A and the band's off-diagonal tiles,
        # Aqk; the tiles above the diagonal blocks are written as zeros (their accumulators never left 0); only the
        # diagonal tile goes to LDS (the inverses read nothing else)
        ak = [fx.memref_load_vec(acc_k[J]) for J in range_constexpr(blocks)]
        aq = [fx.memref_load_vec(acc_q[J]) for J in range_constexpr(blocks)]
        for c in range_constexpr(4):
            i = blk * SUB + 4 * q + c
            t_i = fx.min(t0 + i, t_last)
            rk_i, rq_i = srn[i], srn[CHUNK + i]
            b_i = fx.Float32(B[t_i, h])
            for J in range_constexpr(blocks):
                j = J * SUB + a_row
                rk_j = srn[j]
                a_ij = (j < i).select(ak[J][c] * (b_i * rk_i) * rk_j, 0.0)
                qk_ij = (j <= i).select(aq[J][c] * rq_i * rk_j, 0.0)
                if J == blk:
                    sa[i * CHUNK + j] = a_ij
                if t0 + i < t_end:
                    Aqk[t0 + i, h, j] = qk_ij.to(opnd)
                    if J != blk:  # the A band off the diagonal blocks (zero above them: j > i there)
                        Ab[t0 + i, h, j] = a_ij.to(opnd)
        gpu.barrier()

        # the diagonal blocks' inverses: lane (block, c) solves (I + A_II) t = e_c down the block's rows
        if tid < CHUNK:
            dblk, col = intra_inverse(tid)
            base = dblk * SUB
            t = []
            for r in range_constexpr(SUB):
                acc = (col == r).select(fx.Float32(1.0), fx.Float32(0.0))
                for jj in range_constexpr(r):
                    acc = acc - sa[(base + r) * CHUNK + base + jj] * t[jj]
                t.append(acc)
            for r in range_constexpr(SUB):
                if t0 + base + r < t_end:
                    Ab[t0 + base + r, h, base + col] = t[r].to(opnd)

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
