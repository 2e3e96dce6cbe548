"""Phase 1 of the chunked FlyDSL KDA prefill: per-token preparation, one workgroup per (chunk, head).

Twin of ``rocm_k3.triton_kernels.kda.chunk_prep``. For the n <= 64 rows of one chunk of one head::

    g  = kda_gate(f)               when the gate is fused (else g is the given fp32 log-decay)
    G  = cumsum(g) over the chunk's rows (restarting at every chunk)            fp32 [T, H, K]
    q' = scale * q / sqrt(sum q^2 + 1e-6),  k' = k / sqrt(sum k^2 + 1e-6)       fp32 [T, H, K]
         (without qk_l2norm: q' = scale * q, k' = k)
    b  = sigmoid(beta) with beta_logits, else beta                              fp32 [T, H]

All intermediates are fp32. Tiling: 2K lanes (the decode kernel's lane pairs, ``plans.kda_decode_lane``):
the pair (2c, 2c+1) owns channel c, the even lane stores; the rows are walked in order, the running sum of g
in a register, the two L2 norms as 2K-lane reductions per row.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import CHUNK
from rocm_k3.flydsl_kernels.plans import KDA_LANES_PER_COLUMN


def build_kda_chunk_prep(config):
    """``launch(Q, Kt, G, Beta, ChunkSeq, ChunkStart, CuSeq, ALog, DtBias, Qn, Kn, Gc, B, num_chunks, scale)``.

    Q, Kt [T, H, K] (activation dtype), G [T, H, K] (fp32 log-decay or raw gate input), Beta [T, H];
    ChunkSeq/ChunkStart int32 [NC] and CuSeq int32 [N+1] (``kda_prefill_plan.chunk_plan``); ALog fp32 [H],
    DtBias fp32 [H*K] (read only by the safe/softplus gates); outputs Qn, Kn, Gc fp32 [T, H, K], B fp32 [T, H].
    ``config`` is a :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig`.
    """
    H, K = config.num_heads, config.head_dim
    lanes = KDA_LANES_PER_COLUMN * K
    waves = lanes // common.WAVE

    @fx.struct
    class Shared:
        red: fx.Array[fx.Float32, 8, 16]

    @flyc.kernel
    def kda_chunk_prep_kernel(
        Q: fx.Tensor, Kt: fx.Tensor, G: fx.Tensor, Beta: fx.Tensor, ChunkSeq: fx.Tensor, ChunkStart: fx.Tensor,
        CuSeq: fx.Tensor, ALog: fx.Tensor, DtBias: fx.Tensor, Qn: fx.Tensor, Kn: fx.Tensor, Gc: fx.Tensor,
        B: fx.Tensor, scale: fx.Float32,
    ):
        tid, c, _, lead, ch, h = common.kda_lane()
        t0 = fx.Int32(ChunkStart[ch])
        t_end = fx.min(fx.Int32(CuSeq[fx.Int32(ChunkSeq[ch]) + 1]), t0 + CHUNK)
        red = fx.SharedAllocator().allocate(Shared).peek().red.view(fx.make_layout(8, 1))
        a_h = bias_c = None  # read by the safe and softplus gates only
        if const_expr(config.gate != "logdecay"):
            a_h = fmath.exp(fx.Float32(ALog[h]))
            bias_c = fx.Float32(DtBias[h * K + c])

        gsum = fx.Float32(0.0)
        for t in range(t0, t_end):
            q, k, graw = fx.Float32(Q[t, h, c]), fx.Float32(Kt[t, h, c]), fx.Float32(G[t, h, c])
            g = common.kda_log_decay(config.gate, graw, a_h, bias_c, config.lower_bound)
            gsum = gsum + g
            qs, ks = scale, fx.Float32(1.0)
            if const_expr(config.qk_l2norm):
                qq, kk = common.block_sum2(lead.select(q * q, 0.0), lead.select(k * k, 0.0), red, tid, waves)
                qs = fmath.rsqrt(qq + 1e-6) * scale
                ks = fmath.rsqrt(kk + 1e-6)
            if lead:
                Qn[t, h, c] = q * qs
                Kn[t, h, c] = k * ks
                Gc[t, h, c] = gsum
            if tid == 0:
                beta = fx.Float32(Beta[t, h])
                if const_expr(config.beta_logits):
                    beta = common.sigmoid(beta)
                B[t, h] = beta

    @flyc.jit
    def launch(
        Q: fx.Tensor, Kt: fx.Tensor, G: fx.Tensor, Beta: fx.Tensor, ChunkSeq: fx.Tensor, ChunkStart: fx.Tensor,
        CuSeq: fx.Tensor, ALog: fx.Tensor, DtBias: fx.Tensor, Qn: fx.Tensor, Kn: fx.Tensor, Gc: fx.Tensor,
        B: fx.Tensor, num_chunks: fx.Int32, scale: fx.Float32, stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_chunk_prep_kernel(Q, Kt, G, Beta, ChunkSeq, ChunkStart, CuSeq, ALog, DtBias, Qn, Kn, Gc, B, scale).launch(
            grid=(num_chunks, H), block=(lanes,), stream=stream)

    return launch
