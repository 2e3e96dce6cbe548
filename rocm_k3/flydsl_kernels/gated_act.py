"""FlyDSL SiTU-and-mul / SiLU-and-mul (compile-verified for gfx942/gfx950; not yet run on an AMD GPU).

    x [R, 2N] -> y [R, N]:  y = act(x[:, :N]) * f(x[:, N:])       fp32 math, x dtype out
    SiTU: act(g) = beta*tanh(g/beta)*sigmoid(g), f(u) = lb*tanh(u/lb) (u when lb is None);  SiLU: g*sigmoid(g), u

Used by the shared experts and the dense layer (the routed experts fuse it into the MoE GEMM epilogue).
Tiling: element-wise; lane i of the grid takes flat output vector i (``plans.flat_vector_coord``): one
128-bit load of gate, one of up, one 128-bit store; 256 lanes per workgroup, the last one guarded. One
buffer descriptor per workgroup at its first row (lanes differ only in the offset).

Mapping to the Triton twin: the same element-wise formula and fp32 math (Triton tiles [ROWS, BLOCK_N]).
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.plans import flat_vector_coord

LANES = 256


@dataclasses.dataclass(frozen=True)
class GatedActConfig:
    """N: output width (x is [R, 2N]); dtype; activation ("situ", beta, linear_beta) or ("silu", 0.0, None)."""

    N: int
    dtype: str = "bf16"
    activation: tuple = ("situ", 4.0, 25.0)

    def __post_init__(self) -> None:
        common.check_dtype(self.dtype)
        if self.N <= 0 or self.N % self.vec:
            raise ValueError(f"N={self.N} must be a positive multiple of {self.vec}")
        if self.activation[0] not in ("situ", "silu"):
            raise ValueError(f"activation must be situ or silu, got {self.activation}")

    @property
    def vec(self) -> int:
        return common.vec_elems(self.dtype)


def build_gated_act(cfg: GatedActConfig):
    """``launch(X [R, 2N], Y [R, N], total_vectors)`` with total_vectors = R * N / vec."""
    vec, dt, N = cfg.vec, cfg.dtype, cfg.N
    per_row = N // vec
    span = (LANES - 1) // per_row + 2  # rows a block's 256 vectors can touch
    act = common.fx_dtype(dt)

    @flyc.kernel
    def gated_act_kernel(X: fx.Tensor, Y: fx.Tensor, total: fx.Int32):
        first = gpu.block_idx.x * LANES  # first flat vector of the block (uniform)
        idx = first + gpu.thread_idx.x
        ok = idx < total
        row, col = flat_vector_coord(ok.select(idx, total - 1), per_row, vec)
        row0, _ = flat_vector_coord(first, per_row, vec)
        atom = common.copy_atom(dt, vec)
        x_rows = common.rows_vectors(X, row0, span, 2 * N, vec)  # one descriptor per block
        y_rows = common.rows_vectors(Y, row0, span, N, vec)
        local = row - row0
        gate = common.load_vec(atom, x_rows, local * (2 * per_row) + col // vec, vec, dt).to(fx.Float32)
        up = common.load_vec(atom, x_rows, local * (2 * per_row) + per_row + col // vec, vec, dt).to(fx.Float32)
        y = [common.gated_activation(gate[i], up[i], cfg.activation) for i in range_constexpr(vec)]
        if ok:
            common.store_vec(atom, y_rows, local * per_row + col // vec, fx.Vector.from_elements(y, fx.Float32).to(act),
                             vec, dt)

    @flyc.jit
    def launch(X: fx.Tensor, Y: fx.Tensor, total: fx.Int32, stream: fx.Stream = common.DEFAULT_STREAM):
        gated_act_kernel(X, Y, total).launch(grid=((total + LANES - 1) // LANES,), block=(LANES,), stream=stream)

    return launch
