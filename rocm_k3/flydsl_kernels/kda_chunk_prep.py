"""Phase 1 of the chunked FlyDSL KDA prefill: the gate and its in-chunk sums, one workgroup per (chunk, head).

Twin of ``rocm_k3.triton_kernels.kda.chunk_prep`` with ``GATE_ONLY`` (the Triton default since session 21,
``prefill.NORMS_IN_INTRA``: q and k are not read here; :mod:`.kda_chunk_intra` normalises them). For the n <= 64
rows of one chunk of one head::

    g  = kda_gate(f)               when the gate is fused (else g is the given fp32 log-decay)
    G  = cumsum(g) over the chunk's rows (restarting at every chunk)            fp32 [T, H, K]
    b  = sigmoid(beta) with beta_logits, else beta                              fp32 [T, H]

Tiling: K lanes, lane c owns channel c and walks the rows in order with the running sum of g in a register (no
reductions: the loads and stores of a row are K consecutive values across the lanes); lane 0 writes b.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.kda_prefill_plan import CHUNK


def build_kda_chunk_prep(config):
    """``launch(G, Beta, ChunkSeq, ChunkStart, CuSeq, ALog, DtBias, Gc, B, num_chunks)``.

    G [T, H, K] (fp32 log-decay or raw gate input), Beta [T, H]; ChunkSeq/ChunkStart int32 [NC] and CuSeq int32
    [N+1] (``kda_prefill_plan.chunk_plan``); ALog fp32 [H], DtBias fp32 [H*K] (read only by the safe/softplus
    gates); outputs Gc fp32 [T, H, K], B fp32 [T, H]. ``config`` is a
    :class:`rocm_k3.flydsl_kernels.kda_prefill.KdaPrefillConfig`.
    """
    H, K = config.num_heads, config.head_dim

    @flyc.kernel
    def kda_chunk_prep_kernel(
        G: fx.Tensor, Beta: fx.Tensor, ChunkSeq: fx.Tensor, ChunkStart: fx.Tensor, CuSeq: fx.Tensor,
        ALog: fx.Tensor, DtBias: fx.Tensor, Gc: fx.Tensor, B: fx.Tensor,
    ):
        c = gpu.thread_idx.x  # key channel
        ch = gpu.block_idx.x
        h = gpu.block_idx.y
        t0 = fx.Int32(ChunkStart[ch])
        t_end = fx.min(fx.Int32(CuSeq[fx.Int32(ChunkSeq[ch]) + 1]), t0 + CHUNK)
        a_h = bias_c = None  # read by the safe and softplus gates only
        if const_expr(config.gate != "logdecay"):
            a_h = fmath.exp(fx.Float32(ALog[h]))
            bias_c = fx.Float32(DtBias[h * K + c])

        gsum = fx.Float32(0.0)
        for t in range(t0, t_end):
            gsum = gsum + common.kda_log_decay(config.gate, fx.Float32(G[t, h, c]), a_h, bias_c, config.lower_bound)
            Gc[t, h, c] = gsum
            if c == 0:
                beta = fx.Float32(Beta[t, h])
                if const_expr(config.beta_logits):
                    beta = common.sigmoid(beta)
                B[t, h] = beta

    @flyc.jit
    def launch(
        G: fx.Tensor, Beta: fx.Tensor, ChunkSeq: fx.Tensor, ChunkStart: fx.Tensor, CuSeq: fx.Tensor,
        ALog: fx.Tensor, DtBias: fx.Tensor, Gc: fx.Tensor, B: fx.Tensor, num_chunks: fx.Int32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_chunk_prep_kernel(G, Beta, ChunkSeq, ChunkStart, CuSeq, ALog, DtBias, Gc, B).launch(
            grid=(num_chunks, H), block=(K,), stream=stream)

    return launch
