"""FlyDSL fused Attention-Residuals step (compile-verified for gfx942/gfx950; not yet run on an AMD GPU).

One pass per token over the hidden row (K3_SPEC section 5, op ``attn_res_step``):
    p = (partial + delta) in fp32, cast to the activation dtype      (a missing term counts as 0)
    sources V = [blocks[0], ..., blocks[num_blocks-1], p]
    logit_i = <norm_w * proj_w, V_i> * rsqrt(mean(V_i^2) + eps)     (fp32)
    x = sum_i softmax(logit)_i V_i, cast to the activation dtype
    if write_block: blocks[num_blocks] = p
    normed = x * rsqrt(mean(x^2) + eps) * rms_w

Tiling: one 256-lane workgroup per token; the 7168-wide row is covered with 64-bit accesses (4 bf16 per
lane access, ``plans.row_plan(7168, 4)``: 7 accesses per lane), so a lane holds 28 values of each live
row: the partial sum p, the fp32 mix accumulator and the source being read (about 150 VGPRs with 8 blocks;
the two [Hd] weight vectors are re-read per source from L1 rather than held, which would cost ~70 more).
The softmax is online (running max m, running denominator s; acc and s are rescaled by exp(m_old - m_new)
when a source raises the max), so each source row is read exactly once: global traffic is
(num_blocks + 2) row reads and 2-3 row writes per token. Each source costs one two-value workgroup
reduction (dot and sum of squares) through LDS.

Mapping to the Triton twin (``triton_kernels/attn_res.py``): the same single pass with the same online
softmax over the sources and fp32 accumulation; Triton gives a program ROWS tokens with whole hidden rows in
registers, here a token's row is split over 256 lanes. ``num_blocks``, ``write_block`` and which of
partial/delta are present are compile-time here (at most 9 x 2 x 3 variants, each compiled on first use).
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath
from flydsl.expr.typing import ReductionOp

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.plans import RowPlan, row_plan

ATTN_RES_VEC = 4  # elements per lane access (64-bit for bf16)
_NEG_BIG = -3.0e38


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Static configuration: hidden size, activation dtype, weight dtype, mixed blocks and flags."""

    hidden: int
    num_blocks: int
    write_block: bool
    has_partial: bool = True
    has_delta: bool = True
    dtype: str = "bf16"
    weight_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if not (self.has_partial or self.has_delta):
            raise ValueError("attn_res_step needs partial or delta")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.dtype not in ("bf16", "f16", "f32") or self.weight_dtype not in ("bf16", "f16", "f32"):
            raise ValueError(f"unsupported dtypes {self.dtype}/{self.weight_dtype}")
        self.plan  # noqa: B018 - raises for an untileable hidden size

    @property
    def plan(self) -> RowPlan:
        plan = row_plan(self.hidden, ATTN_RES_VEC)
        if plan.rows_per_block != 1:
            raise ValueError(f"hidden={self.hidden} is too narrow for the one-token-per-workgroup attn_res kernel")
        return plan


def build_attn_res_step(config: AttnResConfig):
    """``launch(partial, delta, blocks, proj_w, norm_w, rms_w, normed, p_out, tokens, eps)``.

    partial/delta/normed/p_out [T, Hd], blocks [B_max, T, Hd] (written at row num_blocks if write_block),
    weights [Hd]. Pass any [T, Hd] tensor for an absent partial/delta (it is not read).
    """
    plan = config.plan
    vec, dt, wdt = ATTN_RES_VEC, config.dtype, config.weight_dtype
    nb = config.num_blocks
    waves = plan.waves
    act = common.fx_dtype(dt)

    @fx.struct
    class Scratch:
        red: fx.Array[fx.Float32, 8, 16]

    @flyc.kernel
    def attn_res_kernel(
        Partial: fx.Tensor, Delta: fx.Tensor, Blocks: fx.Tensor, ProjW: fx.Tensor, NormW: fx.Tensor,
        RmsW: fx.Tensor, Normed: fx.Tensor, POut: fx.Tensor, eps: fx.Float32,
    ):
        tid = gpu.thread_idx.x
        t = gpu.block_idx.x
        lds = fx.SharedAllocator().allocate(Scratch).peek()
        red = lds.red.view(fx.make_layout(8, 1))
        atom = common.copy_atom(dt, vec)
        watom = common.copy_atom(wdt, vec)
        proj = common.flat_vectors(ProjW, vec)
        norm = common.flat_vectors(NormW, vec)
        rms = common.flat_vectors(RmsW, vec)

        # p = partial + delta, rounded to the activation dtype like the reference
        p_row = common.row_vectors(POut, t, vec)
        ps = []
        for i in range_constexpr(plan.tiles):
            j = plan.vector_of(tid, i)
            if const_expr(config.has_partial and config.has_delta):
                a = common.load_vec(atom, common.row_vectors(Partial, t, vec), j, vec, dt).to(fx.Float32)
                b = common.load_vec(atom, common.row_vectors(Delta, t, vec), j, vec, dt).to(fx.Float32)
                p = (a + b).to(act)
            elif const_expr(config.has_partial):
                p = common.load_vec(atom, common.row_vectors(Partial, t, vec), j, vec, dt)
            else:
                p = common.load_vec(atom, common.row_vectors(Delta, t, vec), j, vec, dt)
            common.store_vec(atom, p_row, j, p, vec, dt)
            if const_expr(config.write_block):
                common.store_vec(atom, common.row_vectors(Blocks, (nb, t), vec), j, p, vec, dt)
            ps.append(p.to(fx.Float32))

        # online softmax over the sources, one row read each
        m = fx.Float32(_NEG_BIG)
        s = fx.Float32(0.0)
        acc = [fx.Vector.filled(vec, 0.0, fx.Float32) for _ in range(plan.tiles)]
        for src in range_constexpr(nb + 1):
            vs = []
            dot = fx.Float32(0.0)
            sq = fx.Float32(0.0)
            for i in range_constexpr(plan.tiles):
                j = plan.vector_of(tid, i)
                if const_expr(src < nb):
                    v = common.load_vec(atom, common.row_vectors(Blocks, (src, t), vec), j, vec, dt).to(fx.Float32)
                else:
                    v = ps[i]
                w = common.load_vec(watom, proj, j, vec, wdt).to(fx.Float32) * common.load_vec(
                    watom, norm, j, vec, wdt
                ).to(fx.Float32)
                vs.append(v)
                dot = dot + (v * w).reduce(ReductionOp.ADD)
                sq = sq + (v * v).reduce(ReductionOp.ADD)
            dot, sq = common.block_sum2(dot, sq, red, tid, waves)
            logit = dot * fmath.rsqrt(sq / float(config.hidden) + eps)
            m_new = fx.max(m, logit)
            c = fmath.exp(m - m_new)
            e = fmath.exp(logit - m_new)
            s = s * c + e
            for i in range_constexpr(plan.tiles):
                acc[i] = acc[i] * c + vs[i] * e
            m = m_new

        # x = mix in the activation dtype, then the RMSNorm of the next sublayer
        inv_s = 1.0 / s
        xs = []
        sq = fx.Float32(0.0)
        for i in range_constexpr(plan.tiles):
            x = (acc[i] * inv_s).to(act).to(fx.Float32)
            xs.append(x)
            sq = sq + (x * x).reduce(ReductionOp.ADD)
        sq = common.block_sum(sq, red, tid, waves)
        inv = fmath.rsqrt(sq / float(config.hidden) + eps)
        out_row = common.row_vectors(Normed, t, vec)
        for i in range_constexpr(plan.tiles):
            j = plan.vector_of(tid, i)
            y = xs[i] * inv * common.load_vec(watom, rms, j, vec, wdt).to(fx.Float32)
            common.store_vec(atom, out_row, j, y.to(act), vec, dt)

    @flyc.jit
    def launch(
        Partial: fx.Tensor, Delta: fx.Tensor, Blocks: fx.Tensor, ProjW: fx.Tensor, NormW: fx.Tensor,
        RmsW: fx.Tensor, Normed: fx.Tensor, POut: fx.Tensor, tokens: fx.Int32, eps: fx.Float32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        attn_res_kernel(Partial, Delta, Blocks, ProjW, NormW, RmsW, Normed, POut, eps).launch(
            grid=(tokens,), block=(plan.threads,), stream=stream
        )

    return launch
