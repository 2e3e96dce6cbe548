"""FlyDSL KDA prefill: the configuration shared by its kernels, and the RECURRENT-form kernel (the fallback).

Compile-verified for gfx942 and gfx950 only (the ``compile`` test tier: no scratch, VGPR budgets, MFMA
mnemonics); none of these kernels has been run on an AMD GPU yet — ``pytest -m rocm`` is their parity check.

Chunked form (the default path, ``ops_impl.kda_prefill``): K3_SPEC section 2 with C = 64, G and b in fp32, the
walk's intermediates in its operand type (bf16 for bf16 activations, else fp32), staged over three launches that
mirror the Triton twin ``rocm_k3.triton_kernels.kda`` phase by phase:

    Triton phase             FlyDSL kernel (module)            grid / tiling
    1 chunk_prep             kda_chunk_prep                    (chunk, head), K lanes: gate, in-chunk cumsum G,
      (GATE_ONLY)                                              beta sigmoid -> fp32 G, b
    2 chunk_intra            kda_chunk_intra                   (chunk, head), 4 waves: A (strictly lower, times b)
      (INVERT_DIAG,                                            and Aqk (lower incl. diagonal) as 16 x 16 tiles on the
      WRITE_KB, RAW_QK)                                        walk's MFMA (wave I: tiles (I, J <= I)), the decay
                                                               split at a per-block reference as in the Triton twin,
                                                               the row norms (they factor out of the pair sums) from
                                                               the A rows' sums of squares; the four diagonal blocks'
                                                               inverses T_II = (I + A_II)^-1 by forward substitution
                                                               (one block column per lane) -> A band (T_II on the
                                                               diagonal blocks), Aqk, KB = b exp(G) k',
                                                               QG = q' exp(G), KD = k' exp(G_last - G)
    4 chunk_state            kda_chunk_state                   (16-column value tile, sequence, head), one wave, S in
      (SOLVE_IN, output)                                       registers: V'_I = T_II (b v_I - KB_I S - sum_{J<I}
                                                               A_IJ V'_J) tile by tile, O = QG S + Aqk V',
                                                               S = diag(exp G_last) S + KD^T V', the products on
                                                               v_mfma_f32_16x16x16_bf16 (bf16 activations) or
                                                               v_mfma_f32_16x16x4_f32, fp32 accumulation

The Triton twin's default since session 21 (``prefill.SOLVE_IN_WALK``, ``prefill.NORMS_IN_INTRA``): no phase 3
(chunk_solve), no W or U in memory, q and k read once (by the intra kernel).
Differences from it: the diagonal inverses by substitution on VALU where the Triton twin multiplies four factors on
tensor cores for bf16 dots (``prefill.invert_by_products``, see kda_chunk_intra; its fp16 / fp32 paths substitute
row by row too: the products lose ~1e-4 on correlated keys); the decay factors exp(G) from fp32 G (the Triton twin's
bf16 path reads bf16 sub-block factors, ``GATE_FACTORS``); the diagonal tile's reference is the midpoint of the block's
G range, the earlier blocks' tiles take the block's first row (both factors <= 1 there). Since session 31 the pair
sums and the walk run on the Triton twin's bf16 operands for bf16 activations (before, every product was fp32, the
pair sums on VALU with one exp per pair and channel). Index maps: ``kda_prefill_plan`` (host-tested). Intermediate
states are taken at chunk ends, i.e. rows (i, p) with p % 64 == 0 or p == len_i; any other position makes
``ops_impl`` run the recurrent kernel below for the whole call (``kda_prefill_supports`` names the path).

Recurrent form (this module's kernel): the token recurrence the chunked form is an exact rewrite of, sequentially
over each sequence's tokens, with the state in registers::

    per token t of sequence i, head h (q, k L2-normalised per head, q scaled; beta = sigmoid(b) if logits;
    g = kda_gate(f) when gate parameters are given, else the fp32 log-decay):
        S = diag(exp(g_t)) S;  u = v_t - S^T k_t;  S = S + beta_t k_t u^T;  o_t = S^T q_t

Exact up to fp32 summation order, any intermediate position, no MFMA, T sequential steps per (sequence, head).
Tiling (the decode kernel's): one 2K-lane workgroup per (sequence, head), grid (N, H); the lane pair
(2c, 2c+1) owns key channel c (its q/k/g loads) and value column c of the [K, V] state, each lane K/2 rows
in registers. Per token: two workgroup reductions (the L2 norms) and LDS broadcast of q, k, exp(g); the next
token's inputs are loaded one iteration ahead; the state is read once per sequence and written once per
requested intermediate position plus at the end. Segments: the host splits each sequence at its intermediate
positions (``SegStart/SegEnd/SegRow``); after a segment the state is stored to ``Inter[row]`` (row -1: the
final segment, stored to ``state[slot]``).
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_decode import token_scratch_struct, token_scratch_views
from rocm_k3.flydsl_kernels.plans import KDA_HEAD_DIMS, KDA_LANES_PER_COLUMN, kda_decode_row


@dataclasses.dataclass(frozen=True)
class KdaPrefillConfig:
    """Static configuration: heads, head dim (K = V), dtype of q/k/v, gate and beta variants, l2 norm."""

    num_heads: int
    head_dim: int = 128
    dtype: str = "bf16"
    gate: str = "logdecay"  # "logdecay" (g is fp32 log-decay) | "safe" (lower_bound gate) | "softplus"
    lower_bound: float | None = None
    beta_logits: bool = True
    qk_l2norm: bool = True

    def __post_init__(self) -> None:
        if self.head_dim not in KDA_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {KDA_HEAD_DIMS}, got {self.head_dim}")
        if self.gate not in ("logdecay", "safe", "softplus"):
            raise ValueError(f"gate must be logdecay, safe or softplus, got {self.gate!r}")
        if (self.gate == "safe") != (self.lower_bound is not None):
            raise ValueError("lower_bound is required by (and only by) the safe gate")
        common.check_dtype(self.dtype)


def build_kda_prefill(config: KdaPrefillConfig):
    """``launch(Q, Kt, V, G, Beta, CuSeq, State, Slots, HasInit, SegPtr, SegStart, SegEnd, SegRow, Inter, O,
    ALog, DtBias, N, T, scale)``: shapes as ``rocm_k3.ops.kda.kda_prefill``; HasInit int32 [N]; SegPtr int32
    [N+1] and SegStart/SegEnd/SegRow int32 [G] (token offsets inside the sequence; row -1 = final);
    Inter fp32 [M, H, K, V]; O [T, H, V]; ALog/DtBias only read for the safe/softplus gates; T >= 1."""
    H, K = config.num_heads, config.head_dim
    lanes = KDA_LANES_PER_COLUMN * K
    waves = lanes // common.WAVE
    rows = K // KDA_LANES_PER_COLUMN
    act = common.fx_dtype(config.dtype)

    Shared = token_scratch_struct(K)

    @flyc.kernel
    def kda_prefill_kernel(
        Q: fx.Tensor, Kt: fx.Tensor, V: fx.Tensor, G: fx.Tensor, Beta: fx.Tensor, CuSeq: fx.Tensor,
        State: fx.Tensor, Slots: fx.Tensor, HasInit: fx.Tensor, SegPtr: fx.Tensor, SegStart: fx.Tensor,
        SegEnd: fx.Tensor, SegRow: fx.Tensor, Inter: fx.Tensor, O: fx.Tensor, ALog: fx.Tensor, DtBias: fx.Tensor,
        tokens: fx.Int32, scale: fx.Float32,
    ):
        tid, c, half, lead, n, h = common.kda_lane()
        bos = fx.Int32(CuSeq[n])
        slot = fx.Int32(Slots[n])
        sq, sk, seg, red = token_scratch_views(Shared, K)
        f32 = common.copy_atom("f32", 1)
        tile = common.flat_vectors(common.static_view(fx.slice(State, (slot, h, None, None)), K * K), 1)
        a_h = bias_c = None  # read by the safe and softplus gates only
        if const_expr(config.gate != "logdecay"):
            a_h = fmath.exp(fx.Float32(ALog[h]))
            bias_c = fx.Float32(DtBias[h * K + c])

        # the lane's 64 rows of column c, zero unless the sequence continues a cached state
        # (selected, not multiplied by 0/1: a never-written slot may hold NaN)
        has_init = fx.Int32(HasInit[n]) != 0
        col = fx.make_rmem_tensor(rows, fx.Float32)
        col.store(fx.Vector.from_elements(
            [has_init.select(common.load_vec(f32, tile, kda_decode_row(half, i, K) * K + c, 1, "f32")[0], 0.0)
             for i in range_constexpr(rows)], fx.Float32))

        last = tokens - 1
        for sgi in range(fx.Int32(SegPtr[n]), fx.Int32(SegPtr[n + 1])):
            t_first = bos + fx.Int32(SegStart[sgi])
            # the inputs of the next token are loaded one step ahead (loop-carried), so their global-memory
            # latency overlaps the current token's reductions; indices are clamped into [0, T-1]
            tp = fx.min(t_first, last)
            nq, nk, nv = fx.Float32(Q[tp, h, c]), fx.Float32(Kt[tp, h, c]), fx.Float32(V[tp, h, c])
            ng, nb = fx.Float32(G[tp, h, c]), fx.Float32(Beta[tp, h])
            for t in range(t_first, bos + fx.Int32(SegEnd[sgi])):
                q, k, v, graw, beta = nq, nk, nv, ng, nb
                tp = fx.min(t + 1, last)
                nq, nk, nv = fx.Float32(Q[tp, h, c]), fx.Float32(Kt[tp, h, c]), fx.Float32(V[tp, h, c])
                ng, nb = fx.Float32(G[tp, h, c]), fx.Float32(Beta[tp, h])
                g = common.kda_log_decay(config.gate, graw, a_h, bias_c, config.lower_bound)
                if const_expr(config.beta_logits):
                    beta = common.sigmoid(beta)
                if const_expr(config.qk_l2norm):
                    qq, kk = common.block_sum2(lead.select(q * q, 0.0), lead.select(k * k, 0.0), red, tid, waves)
                    q = q * fmath.rsqrt(qq + 1e-6)
                    k = k * fmath.rsqrt(kk + 1e-6)
                sq[c] = q * scale
                sk[c] = k
                seg[c] = fmath.exp(g)
                gpu.barrier()
                s = fx.memref_load_vec(col)
                decayed = []
                dot = fx.Float32(0.0)
                for i in range_constexpr(rows):
                    r = kda_decode_row(half, i, K)
                    d_r = s[i] * seg[r]
                    decayed.append(d_r)
                    dot = dot + d_r * sk[r]
                dot = dot + dot.shuffle_xor(1, common.WAVE)
                u = (v - dot) * beta
                new = []
                o = fx.Float32(0.0)
                for i in range_constexpr(rows):
                    r = kda_decode_row(half, i, K)
                    s_r = decayed[i] + sk[r] * u
                    new.append(s_r)
                    o = o + s_r * sq[r]
                col.store(fx.Vector.from_elements(new, fx.Float32))
                o = o + o.shuffle_xor(1, common.WAVE)
                if lead:
                    O[t, h, c] = o.to(act)
                gpu.barrier()  # every lane has read sq/sk/seg before the next token overwrites them
            row = fx.Int32(SegRow[sgi])
            s = fx.memref_load_vec(col)
            if row >= 0:
                for i in range_constexpr(rows):
                    Inter[row, h, kda_decode_row(half, i, K), c] = s[i]

        s = fx.memref_load_vec(col)
        for i in range_constexpr(rows):
            r = kda_decode_row(half, i, K)
            common.store_vec(f32, tile, r * K + c, fx.Vector.filled(1, s[i], fx.Float32), 1, "f32")

    @flyc.jit
    def launch(
        Q: fx.Tensor, Kt: fx.Tensor, V: fx.Tensor, G: fx.Tensor, Beta: fx.Tensor, CuSeq: fx.Tensor,
        State: fx.Tensor, Slots: fx.Tensor, HasInit: fx.Tensor, SegPtr: fx.Tensor, SegStart: fx.Tensor,
        SegEnd: fx.Tensor, SegRow: fx.Tensor, Inter: fx.Tensor, O: fx.Tensor, ALog: fx.Tensor, DtBias: fx.Tensor,
        num_seqs: fx.Int32, tokens: fx.Int32, scale: fx.Float32, stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_prefill_kernel(
            Q, Kt, V, G, Beta, CuSeq, State, Slots, HasInit, SegPtr, SegStart, SegEnd, SegRow, Inter, O, ALog,
            DtBias, tokens, scale,
        ).launch(grid=(num_seqs, H), block=(lanes,), stream=stream)

    return launch
