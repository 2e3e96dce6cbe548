"""FlyDSL noaux_tc MoE routing (compile-verified for gfx942/gfx950; not yet run on an AMD GPU).

Op ``route`` (K3_SPEC section 4): ``s = sigmoid(logits)`` in fp32; choose the top-k experts by ``s + bias``
(the bias only selects; ties go to the lower expert index, ids ordered by descending score);
``w = s[chosen]``, renormalised to sum 1 if asked, times the scaling factor.

Tiling: one 256-lane workgroup per token; expert ``e`` lives in lane ``e % 256`` slot ``e // 256``
(``plans.route_slot``: 4 slots for K3's 896 experts). k rounds of a workgroup arg-max over (score, -index):
lane-local over its slots, xor-shuffle butterfly inside each wave, then across the 4 waves through LDS;
the owner of the winner drops it (score -inf) and records its sigmoid in LDS. Finally lanes 0..k-1 write
the renormalised weights and ids.

Mapping to the Triton twin: the same selection order and tie rule, fp32 scores, one token per program.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.plans import route_expert

LANES = 256
_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """E experts, top_k, whether a correction bias is given, renormalise, scaling factor."""

    num_experts: int
    top_k: int
    has_bias: bool = True
    renormalize: bool = True
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= min(self.num_experts, LANES):
            raise ValueError(f"top_k must be in [1, min(E, {LANES})], got {self.top_k} (E={self.num_experts})")

    @property
    def slots(self) -> int:
        return (self.num_experts + LANES - 1) // LANES


def _better(k1, i1, k2, i2):
    """Whether candidate 2 beats candidate 1: higher score, or the same score and a lower expert index."""
    return (k2 > k1) | ((k2 == k1) & (i2 < i1))


def build_route(cfg: RouteConfig):
    """``launch(Logits fp32 [T, E], Bias fp32 [E], W fp32 [T, k], Ids int32 [T, k], tokens)``."""
    E, k, slots = cfg.num_experts, cfg.top_k, cfg.slots
    waves = LANES // common.WAVE

    @fx.struct
    class Shared:
        key: fx.Array[fx.Float32, 4, 16]
        idx: fx.Array[fx.Int32, 4, 16]
        chosen_s: fx.Array[fx.Float32, 256, 16]
        chosen_i: fx.Array[fx.Int32, 256, 16]

    @flyc.kernel
    def route_kernel(Logits: fx.Tensor, Bias: fx.Tensor, W: fx.Tensor, Ids: fx.Tensor):
        t = gpu.block_idx.x
        lane = gpu.thread_idx.x
        lds = fx.SharedAllocator().allocate(Shared).peek()
        s_key = lds.key.view(fx.make_layout(4, 1))
        s_idx = lds.idx.view(fx.make_layout(4, 1))
        c_s = lds.chosen_s.view(fx.make_layout(256, 1))
        c_i = lds.chosen_i.view(fx.make_layout(256, 1))
        scores, keys = [], []
        for j in range_constexpr(slots):
            e = route_expert(lane, j, LANES)
            valid = e < E
            s = common.sigmoid(fx.Float32(Logits[t, valid.select(e, 0)]))
            key = s + fx.Float32(Bias[valid.select(e, 0)]) if cfg.has_bias else s
            scores.append(s)
            keys.append(valid.select(key, _NEG_INF))
        for r in range_constexpr(k):
            best_k, best_i = keys[0], route_expert(lane, 0, LANES)
            for j in range_constexpr(1, slots):
                e = route_expert(lane, j, LANES)
                take = _better(best_k, best_i, keys[j], e)
                best_k, best_i = take.select(keys[j], best_k), take.select(e, best_i)
            off = common.WAVE // 2
            while off >= 1:
                ok, oi = best_k.shuffle_xor(off, common.WAVE), best_i.shuffle_xor(off, common.WAVE)
                take = _better(best_k, best_i, ok, oi)
                best_k, best_i = take.select(ok, best_k), take.select(oi, best_i)
                off //= 2
            s_key[lane // common.WAVE] = best_k
            s_idx[lane // common.WAVE] = best_i
            gpu.barrier()
            win_k, win_i = s_key[0], s_idx[0]
            for w in range_constexpr(1, waves):
                take = _better(win_k, win_i, s_key[w], s_idx[w])
                win_k, win_i = take.select(s_key[w], win_k), take.select(s_idx[w], win_i)
            gpu.barrier()
            for j in range_constexpr(slots):  # the owner drops the winner and records its sigmoid
                mine = route_expert(lane, j, LANES) == win_i
                if mine:
                    c_s[r] = scores[j]
                    c_i[r] = win_i
                keys[j] = mine.select(_NEG_INF, keys[j])
        gpu.barrier()
        total = fx.Float32(0.0)
        for r in range_constexpr(k):
            total = total + c_s[r]
        if lane < k:
            w = c_s[lane]
            if const_expr(cfg.renormalize):
                w = w / total
            W[t, lane] = w * cfg.scaling_factor
            Ids[t, lane] = c_i[lane]

    @flyc.jit
    def launch(Logits: fx.Tensor, Bias: fx.Tensor, W: fx.Tensor, Ids: fx.Tensor, tokens: fx.Int32,
               stream: fx.Stream = common.DEFAULT_STREAM):
        route_kernel(Logits, Bias, W, Ids).launch(grid=(tokens,), block=(LANES,), stream=stream)

    return launch
