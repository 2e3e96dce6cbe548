"""FlyDSL RMSNorm and gated RMSNorm (compile-verified for gfx942/gfx950; not yet run on an AMD GPU).

Math (fp32 inside, output in the activation dtype):
    rms_norm:       y = x * rsqrt(mean(x^2) + eps) * w
    add_rms_norm:   r' = (x + r) in fp32, cast to the dtype (written back as the new residual); y = rms_norm(r')
    gated_rms_norm: y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate)      (per 128-wide head)

Tiling (``plans.row_plan``): rows of D elements are read with 128-bit buffer loads (8 bf16/fp16 or
4 fp32 per lane access). Wide rows (K3 hidden 7168 bf16 = 896 vectors) take one 128-lane workgroup per
row, 7 vectors per lane, kept in registers between the sum-of-squares pass and the scaling pass
(one global read, one write); the sum crosses waves through 2 LDS slots. Narrow rows (a KDA head,
D = 128 bf16 = 16 vectors) put 16 lanes on a row and 16 rows in a 256-lane workgroup; the sum is a
4-step xor shuffle inside the 16-lane group. Either way the workgroup addresses its rows through one
buffer descriptor at its first row (``common.rows_vectors``), the lane's row going into the offset.

Mapping to the Triton twin (``triton_kernels/norm.py``): the same single kernel with compile-time switches
for the residual add and the gate, the same fp32 sum of squares and rsqrt; Triton holds ROWS whole rows in a
[ROWS, BLOCK_D] tile per program, here a row is split over the lanes of a workgroup (or a 16-lane group) and
the reduction is an explicit shuffle / LDS tree. The rounded residual sum is normalised in both.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath
from flydsl.expr.typing import ReductionOp

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.plans import RowPlan, row_plan

_DTYPES = ("bf16", "f16", "f32")


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Static configuration of one compiled norm kernel.

    D: row length (normalised dim); dtype: activation dtype name; weight_dtype: dtype name of ``w``;
    gated: multiply by sigmoid(gate) (gate has the activation dtype and the shape of x);
    residual: add the second input first and write the sum (add_rms_norm). gated and residual exclude each other.
    """

    D: int
    dtype: str = "bf16"
    weight_dtype: str = "bf16"
    gated: bool = False
    residual: bool = False

    def __post_init__(self) -> None:
        if self.gated and self.residual:
            raise ValueError("a norm kernel is gated or residual, not both")
        if self.dtype not in _DTYPES or self.weight_dtype not in _DTYPES:
            raise ValueError(f"dtype and weight_dtype must be in {_DTYPES}, got {self.dtype}/{self.weight_dtype}")
        if common.itemsize(self.weight_dtype) < common.itemsize(self.dtype) and self.weight_dtype != self.dtype:
            raise ValueError(f"weight dtype {self.weight_dtype} narrower than activations {self.dtype}")
        row_plan(self.D, common.vec_elems(self.dtype))  # raises for untileable D

    @property
    def plan(self) -> RowPlan:
        return row_plan(self.D, common.vec_elems(self.dtype))


def build_norm(config: NormConfig):
    """A ``@flyc.jit`` launcher ``launch(x [R, D], g [R, D], w [D], y [R, D], rows, eps)``.

    ``g`` is the gate (``config.gated``), the residual (``config.residual``: overwritten in place with
    x + residual), otherwise ignored (pass ``x``). ``rows`` = R (runtime), ``eps`` runtime fp32.
    """
    plan = config.plan
    vec, dt, wdt = plan.vec, config.dtype, config.weight_dtype
    wvec = common.vec_elems(wdt)
    w_loads = vec // wvec  # 128-bit weight loads per activation vector (2 for fp32 weights with bf16 x)
    gated = config.gated
    residual = config.residual
    D = config.D

    @fx.struct
    class Scratch:
        red: fx.Array[fx.Float32, 4, 16]

    @flyc.kernel
    def norm_kernel(X: fx.Tensor, G: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, rows: fx.Int32, eps: fx.Float32):
        tid = gpu.thread_idx.x
        row0 = gpu.block_idx.x * plan.rows_per_block  # first row of the block (uniform)
        row = row0 + plan.row_of(tid)
        in_range = row < rows
        local = in_range.select(row, rows - 1) - row0  # lanes past the last row redo it and skip the store
        lds = fx.SharedAllocator().allocate(Scratch).peek()
        red = lds.red.view(fx.make_layout(4, 1))
        atom = common.copy_atom_128(dt)
        watom = common.copy_atom_128(wdt)
        span = plan.rows_per_block
        x_rows = common.rows_vectors(X, row0, span, D, vec)
        y_rows = common.rows_vectors(Y, row0, span, D, vec)
        w_all = common.flat_vectors(W, wvec)
        if const_expr(gated or residual):
            g_rows = common.rows_vectors(G, row0, span, D, vec)
        base = local * (D // vec)  # first vector of this lane's row in the block views

        xs = []
        sumsq = fx.Float32(0.0)
        for i in range_constexpr(plan.tiles):
            v = common.load_vec(atom, x_rows, base + plan.vector_of(tid, i), vec, dt).to(fx.Float32)
            if const_expr(residual):
                r_sum = (v + common.load_vec(atom, g_rows, base + plan.vector_of(tid, i), vec, dt).to(fx.Float32)).to(
                    common.fx_dtype(dt))
                if in_range:
                    common.store_vec(atom, g_rows, base + plan.vector_of(tid, i), r_sum, vec, dt)
                v = r_sum.to(fx.Float32)
            xs.append(v)
            sumsq = sumsq + (v * v).reduce(ReductionOp.ADD)
        if const_expr(plan.rows_per_block == 1):
            sumsq = common.block_sum(sumsq, red, tid, plan.waves)
        else:
            sumsq = common.group_sum(sumsq, plan.lanes_per_row)
        inv = fmath.rsqrt(sumsq / float(D) + eps)

        for i in range_constexpr(plan.tiles):
            j = plan.vector_of(tid, i)
            parts = [common.load_vec(watom, w_all, j * w_loads + h, wvec, wdt).to(fx.Float32) for h in range(w_loads)]
            w = parts[0] if w_loads == 1 else common.vector_of([p[e] for p in parts for e in range(wvec)], fx.Float32)
            y = xs[i] * inv * w
            if const_expr(gated):
                g = common.load_vec(atom, g_rows, base + j, vec, dt).to(fx.Float32)
                y = y * common.sigmoid(g)
            if in_range:
                common.store_vec(atom, y_rows, base + j, y.to(common.fx_dtype(dt)), vec, dt)

    @flyc.jit
    def launch(
        X: fx.Tensor, G: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, rows: fx.Int32, eps: fx.Float32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        blocks = (rows + (plan.rows_per_block - 1)) // plan.rows_per_block
        norm_kernel(X, G, W, Y, rows, eps).launch(grid=(blocks,), block=(plan.threads,), stream=stream)

    return launch
