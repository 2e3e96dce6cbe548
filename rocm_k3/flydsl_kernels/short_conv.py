"""FlyDSL varlen causal depthwise short convolution (compile-verified for gfx942/gfx950; not yet run on a GPU).

Op ``short_conv`` (KDA prefill, K3_SPEC section 2 step 2), width W = 4, no bias, then SiLU:

    y[t, c] = act(sum_j w[c, j] * h[t - (W-1) + j, c])      h = (history of W-1 inputs, the sequence's inputs)

The history of sequence i is ``conv_state[state_indices[i]]`` (oldest first) when it has an initial state,
else zeros; afterwards the slot holds the last W-1 entries of (history, inputs).

Tiling: two kernels on one stream. (1) Fully parallel over tokens: grid (T, C/256), lane = channel, each
output reads its W inputs straight from x (coalesced across channels) or, for the first W-1 positions of
a sequence, from the old conv state; fp32 math. (2) Grid (N, C/256): each lane loads the W-1 new history
entries of its channel (all loads before any store, since it overwrites the slot it reads) and writes
them. Kernel (2) runs after (1) because (1) still reads the old history.

Mapping to the Triton twin: the same per-token window formula in fp32 and the same separate history update.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from rocm_k3.flydsl_kernels import common

LANES = 256


@dataclasses.dataclass(frozen=True)
class ShortConvConfig:
    """C channels, width W, activation dtype, SiLU or identity, whether a conv-state pool is given."""

    channels: int
    width: int = 4
    dtype: str = "bf16"
    silu: bool = True
    has_state: bool = True

    def __post_init__(self) -> None:
        if self.width < 2:
            raise ValueError(f"width must be >= 2, got {self.width}")
        if self.channels < 1:
            raise ValueError(f"channels must be >= 1, got {self.channels}")
        common.check_dtype(self.dtype)


def build_short_conv(cfg: ShortConvConfig):
    """``launch(X [T, C], Wt [C, W], CuSeq [N+1], SeqId int32 [T], ConvState [S, C, W-1], Slots [N],
    HasInit int32 [N], Y [T, C], T, N)`` (pass any tensors for the state arguments without a state)."""
    W, C = cfg.width, cfg.channels
    hist = W - 1
    cblocks = (C + LANES - 1) // LANES
    act = common.fx_dtype(cfg.dtype)

    def history(X, ConvState, bos, slot, init, c, q, t_fallback):
        """Input at position q (< 0: history entry W-1+q) of the sequence starting at token bos, fp32."""
        from_x = q >= 0
        xv = fx.Float32(X[from_x.select(bos + q, t_fallback), c])
        if const_expr(not cfg.has_state):
            return from_x.select(xv, 0.0)
        sv = fx.Float32(ConvState[slot, c, from_x.select(0, hist + q)])
        return from_x.select(xv, init.select(sv, 0.0))

    @flyc.kernel
    def short_conv_kernel(X: fx.Tensor, Wt: fx.Tensor, CuSeq: fx.Tensor, SeqId: fx.Tensor, ConvState: fx.Tensor,
                          Slots: fx.Tensor, HasInit: fx.Tensor, Y: fx.Tensor):
        t = gpu.block_idx.x
        lane_c = gpu.block_idx.y * LANES + gpu.thread_idx.x
        ok = lane_c < C
        c = ok.select(lane_c, 0)
        seq = fx.Int32(SeqId[t])
        bos = fx.Int32(CuSeq[seq])
        slot = fx.Int32(Slots[seq])
        init = fx.Int32(HasInit[seq]) != 0
        acc = fx.Float32(0.0)
        for j in range_constexpr(W):
            q = t - bos - hist + j
            acc = acc + fx.Float32(Wt[c, j]) * history(X, ConvState, bos, slot, init, c, q, t)
        if const_expr(cfg.silu):
            acc = common.silu(acc)
        if ok:
            Y[t, c] = acc.to(act)

    @flyc.kernel
    def conv_state_kernel(X: fx.Tensor, CuSeq: fx.Tensor, ConvState: fx.Tensor, Slots: fx.Tensor,
                          HasInit: fx.Tensor):
        n = gpu.block_idx.x
        lane_c = gpu.block_idx.y * LANES + gpu.thread_idx.x
        ok = lane_c < C
        c = ok.select(lane_c, 0)
        bos = fx.Int32(CuSeq[n])
        length = fx.Int32(CuSeq[n + 1]) - bos
        slot = fx.Int32(Slots[n])
        init = fx.Int32(HasInit[n]) != 0
        new = [history(X, ConvState, bos, slot, init, c, length - hist + j, 0) for j in range_constexpr(hist)]
        if ok:
            for j in range_constexpr(hist):
                ConvState[slot, c, j] = new[j].to(ConvState.element_type)

    @flyc.jit
    def launch(X: fx.Tensor, Wt: fx.Tensor, CuSeq: fx.Tensor, SeqId: fx.Tensor, ConvState: fx.Tensor,
               Slots: fx.Tensor, HasInit: fx.Tensor, Y: fx.Tensor, tokens: fx.Int32, num_seqs: fx.Int32,
               stream: fx.Stream = common.DEFAULT_STREAM):
        short_conv_kernel(X, Wt, CuSeq, SeqId, ConvState, Slots, HasInit, Y).launch(
            grid=(tokens, cblocks), block=(LANES,), stream=stream
        )
        if const_expr(cfg.has_state):
            conv_state_kernel(X, CuSeq, ConvState, Slots, HasInit).launch(
                grid=(num_seqs, cblocks), block=(LANES,), stream=stream
            )

    return launch
