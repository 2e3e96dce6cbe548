"""FlyDSL helpers of the MoE pipeline: MXFP8 activation quantisation and the top-k reduction.

Compile-verified for gfx942/gfx950 only; not yet run on an AMD GPU.

``build_mxfp8_quant``: x [R, K] (bf16/f16/f32) -> codes uint8 [R, K] (e4m3 FNUZ on gfx942, OCP on gfx950)
and E8M0 scales uint8 [R, K/32] with the compressed-tensors rule of ``rocm_k3.quant``:
    amax' exponent = floor(log2(amax)) + (mantissa(amax) >= 1.75);  e = clamp(that - emax, -127, 127)
    (emax 7 for FNUZ, 8 for OCP; an all-zero block gets e = -127), q = rne(clamp(x / 2^e, +-max)).
Tiling: one lane per MX block of 32 (read as 4 x 16-byte bf16 loads), 64 lanes per workgroup, grid
(R, ceil(K/32/64)). Used for x before stage 1 and for h before stage 2 of A8W4.

``build_moe_reduce``: y fp32 [splits * T*top_k, Kout] (already weighted; K-split s of stage 2 at rows
s * T*top_k + pair) -> out [T, Kout] = sum over the splits and top_k rows of each token in a fixed order (fp32,
deterministic), cast to the activation dtype. ``plans.row_plan(Kout, 4)``: one workgroup per
token, 16-byte fp32 loads.

Mapping to the Triton twin (``triton_kernels/moe``): the same per-32 compressed-tensors scale rule as its
MXFP8 pre-pass (which Triton also applies to h, inside the w13 epilogue) and the same fp32 top-k sum.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr.typing import T

from rocm_k3.flydsl_kernels import bitcodes, common
from rocm_k3.flydsl_kernels.plans import RowPlan, row_plan

QUANT_LANES = 64


@dataclasses.dataclass(frozen=True)
class Mxfp8QuantConfig:
    """K: row length (multiple of 32); dtype: input dtype name; fnuz: e4m3fnuz (gfx942) or OCP e4m3fn."""

    K: int
    dtype: str = "bf16"
    fnuz: bool = True

    def __post_init__(self) -> None:
        if self.K <= 0 or self.K % 32:
            raise ValueError(f"K must be a positive multiple of 32, got {self.K}")
        common.check_dtype(self.dtype)

    @property
    def emax(self) -> int:
        return 7 if self.fnuz else 8

    @property
    def max_value(self) -> float:
        return 240.0 if self.fnuz else 448.0


def build_mxfp8_quant(cfg: Mxfp8QuantConfig):
    """``launch(X [R, K], Q uint8 [R, K], S uint8 [R, K/32], rows)``."""
    blocks = cfg.K // 32
    emax, vmax = cfg.emax, cfg.max_value

    @flyc.kernel
    def mxfp8_quant_kernel(X: fx.Tensor, Q: fx.Tensor, S: fx.Tensor):
        row = gpu.block_idx.x
        b = gpu.block_idx.y * QUANT_LANES + gpu.thread_idx.x
        ok = b < blocks
        b = ok.select(b, 0)
        xs = [fx.Float32(X[row, b * 32 + i]) for i in range_constexpr(32)]
        amax = fx.Float32(0.0)
        for v in xs:
            amax = fx.max(amax, fx.math.absf(v))
        e = bitcodes.mx_scale_exponent(amax.bitcast(fx.Int32), emax, bitcodes.dsl_select)
        inv = bitcodes.pow2_neg_f32_bits(e).bitcast(fx.Float32)  # 2^-e, exact
        if ok:
            S[row, b] = (e + 127).to(fx.Int8)
            ys = [fx.max(fx.min(v * inv, vmax), -vmax) for v in xs]
            for w in range_constexpr(8):  # v_cvt_pk_fp8_f32: RNE to the target's e4m3 (FNUZ on gfx942)
                lo = fx.rocdl.cvt_pk_fp8_f32(T.i32, ys[4 * w], ys[4 * w + 1], fx.Int32(0), False)
                word = fx.Int32(fx.rocdl.cvt_pk_fp8_f32(T.i32, ys[4 * w + 2], ys[4 * w + 3], lo, True))
                for i in range_constexpr(4):
                    code = (word >> (8 * i)) & 255
                    if const_expr(cfg.fnuz):
                        code = (code == 0x80).select(fx.Int32(0), code)  # FNUZ has no -0 (0x80 is NaN)
                    Q[row, b * 32 + 4 * w + i] = code.to(fx.Int8)

    @flyc.jit
    def launch(X: fx.Tensor, Q: fx.Tensor, S: fx.Tensor, rows: fx.Int32, stream: fx.Stream = common.DEFAULT_STREAM):
        mxfp8_quant_kernel(X, Q, S).launch(
            grid=(rows, (blocks + QUANT_LANES - 1) // QUANT_LANES), block=(QUANT_LANES,), stream=stream
        )

    return launch


@dataclasses.dataclass(frozen=True)
class MoeReduceConfig:
    """Kout: row length; top_k; dtype: output dtype name; splits: K splits of stage 2 to add as well."""

    Kout: int
    top_k: int
    dtype: str = "bf16"
    splits: int = 1

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")
        self.plan  # noqa: B018 - raises for an untileable Kout

    @property
    def plan(self) -> RowPlan:
        plan = row_plan(self.Kout, 4)
        if plan.rows_per_block != 1:
            raise ValueError(f"Kout={self.Kout} too narrow for the one-token-per-workgroup reduction")
        return plan


def build_moe_reduce(cfg: MoeReduceConfig):
    """``launch(Y fp32 [splits * T*top_k, Kout], Out [T, Kout], tokens)``."""
    plan = cfg.plan
    act = common.fx_dtype(cfg.dtype)

    @flyc.kernel
    def moe_reduce_kernel(Y: fx.Tensor, Out: fx.Tensor, tokens: fx.Int32):
        tid = gpu.thread_idx.x
        t = gpu.block_idx.x
        f32 = common.copy_atom("f32", 4)
        out_atom = common.copy_atom(cfg.dtype, 4)
        out_row = common.row_vectors(Out, t, 4)
        for i in range_constexpr(plan.tiles):
            j = plan.vector_of(tid, i)
            acc = fx.Vector.filled(4, 0.0, fx.Float32)
            for sp in range_constexpr(cfg.splits):
                for s in range_constexpr(cfg.top_k):
                    row = (sp * tokens + t) * cfg.top_k + s
                    acc = acc + common.load_vec(f32, common.row_vectors(Y, row, 4), j, 4, "f32")
            common.store_vec(out_atom, out_row, j, acc.to(act), 4, cfg.dtype)

    @flyc.jit
    def launch(Y: fx.Tensor, Out: fx.Tensor, tokens: fx.Int32, stream: fx.Stream = common.DEFAULT_STREAM):
        moe_reduce_kernel(Y, Out, tokens).launch(grid=(tokens,), block=(plan.threads,), stream=stream)

    return launch
