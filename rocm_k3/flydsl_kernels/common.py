"""Device-side helpers shared by the FlyDSL kernels (called while a kernel is traced).

Everything here emits FlyDSL IR and must be called from inside a ``@flyc.kernel`` body. Math that LLVM's
AMDGPU backend has no instruction for (``tanh``: "no libcall available") is written with ``exp``.

Conventions: a wave is 64 lanes (CDNA3/CDNA4); all reductions accumulate in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import flydsl.expr as fx
import torch
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels.plans import kda_decode_lane

WAVE = 64
DEFAULT_STREAM = fx.Stream(None)  # launcher default: the null stream (host wrappers pass torch's current one)

_FX_DTYPES = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}
_TORCH_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4}


def dtype_name(dtype: torch.dtype) -> str:
    """'bf16' | 'f16' | 'f32' for a torch floating dtype the kernels accept."""
    try:
        return _TORCH_NAMES[dtype]
    except KeyError:
        raise TypeError(f"FlyDSL kernels take bf16, fp16 or fp32 activations, got {dtype}") from None


def check_dtype(name: str) -> str:
    """A kernel config's activation dtype name: 'bf16' | 'f16' | 'f32' (ValueError otherwise)."""
    if name not in _FX_DTYPES:
        raise ValueError(f"unsupported dtype {name}")
    return name


def fx_dtype(name: str):
    return _FX_DTYPES[name]


def itemsize(name: str) -> int:
    return _ITEMSIZE[name]


def vec_elems(name: str) -> int:
    """Elements moved by one 128-bit access (8 for bf16/fp16, 4 for fp32)."""
    return 16 // _ITEMSIZE[name]


def copy_atom_128(name: str):
    return fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 8 * _ITEMSIZE[name])


def copy_atom(name: str, n: int):
    """Buffer copy atom moving ``n`` elements of dtype ``name`` in one access (32, 64 or 128 bits)."""
    bits = 8 * _ITEMSIZE[name] * n
    ops = {16: fx.rocdl.BufferCopy16b, 32: fx.rocdl.BufferCopy32b, 64: fx.rocdl.BufferCopy64b,
           128: fx.rocdl.BufferCopy128b}
    if bits not in ops:
        raise ValueError(f"no buffer copy of {bits} bits ({n} x {name})")
    return fx.make_copy_atom(ops[bits](), 8 * _ITEMSIZE[name])


def load_vec(atom, divided, index, n: int, name: str):
    """Load ``n`` contiguous elements (one 128-bit access) at tile ``index`` of a row divided into n-vectors."""
    reg = fx.make_rmem_tensor(n, fx_dtype(name))
    fx.copy(atom, fx.slice(divided, (None, index)), reg)
    return fx.memref_load_vec(reg)


def store_vec(atom, divided, index, value, n: int, name: str):
    """Store an n-vector (already in the element dtype) to tile ``index`` of a divided row."""
    reg = fx.make_rmem_tensor(n, fx_dtype(name))
    fx.memref_store_vec(value, reg)
    fx.copy(atom, reg, fx.slice(divided, (None, index)))


def row_vectors(tensor, coord, n: int):
    """The row ``tensor[coord..., :]`` as a buffer view divided into n-element tiles.

    ``coord`` is the row index of a 2-D tensor or a tuple of leading indices. The row is sliced on the
    global (64-bit) pointer first and the buffer descriptor is built at the row start, so tensors larger
    than the 4 GiB a buffer descriptor can address are fine. Buffer accesses are not bounds-checked on
    CDNA: callers pass in-range rows only.
    """
    coord = coord if isinstance(coord, tuple) else (coord,)
    row = fx.slice(tensor, (*coord, None))
    return fx.logical_divide(fx.rocdl.make_buffer_tensor(row), fx.make_layout(n, 1))


def rows_vectors(tensor, row0, rows: int, D: int, n: int):
    """``rows`` contiguous rows of length ``D`` starting at the workgroup-uniform row ``row0``, as ONE buffer
    view divided into n-element tiles: tile ``local_row * (D // n) + j`` is vector j of row row0 + local_row.

    For kernels whose lanes work on different rows: the buffer descriptor must be uniform across the wave
    (a per-lane descriptor makes LLVM emit a readfirstlane waterfall loop around every access), so the
    base is the block's first row and the row offset goes into the per-lane voffset. The tensor must be
    contiguous (the host wrappers make it so).
    """
    return flat_vectors(static_view(fx.slice(tensor, (row0, None)), rows * D), n)


def static_view(tensor, size: int):
    """The contiguous memory of ``tensor`` as a 1-D view of static length ``size`` (stride 1).

    Launchers receive layout-dynamic tensors; indexing a static 1-D view lets LLVM fold constant parts
    of an offset into instruction immediates instead of computing a coordinate per access. Only for
    tensors the backend has checked to be contiguous.
    """
    return fx.make_view(fx.get_iter(tensor), fx.make_layout(size, 1))


def flat_vectors(tensor, n: int):
    """A 1-D global tensor as a buffer view divided into n-element tiles."""
    return fx.logical_divide(fx.rocdl.make_buffer_tensor(tensor), fx.make_layout(n, 1))


def group_sum(x, width: int):
    """Sum of ``x`` over aligned groups of ``width`` lanes (width a power of two <= 64), via xor shuffles."""
    shift = width // 2
    while shift >= 1:
        x = x + x.shuffle_xor(shift, WAVE)
        shift //= 2
    return x


def group_max(x, width: int):
    shift = width // 2
    while shift >= 1:
        x = fx.max(x, x.shuffle_xor(shift, WAVE))
        shift //= 2
    return x


def block_sum(x, scratch, tid, waves: int):
    """Sum of ``x`` over a workgroup of ``waves`` waves; ``scratch`` is an LDS fp32 view of >= waves slots.

    Every lane of a wave holds the wave total after the butterfly, so all of them store the same value
    to the wave's slot (no lane predicate needed). Ends with a barrier, so it may be called repeatedly
    with the same scratch.
    """
    x = group_sum(x, WAVE)
    if waves == 1:
        return x
    scratch[tid // WAVE] = x
    gpu.barrier()
    total = scratch[0]
    for w in range_constexpr(1, waves):
        total = total + scratch[w]
    gpu.barrier()
    return total


def block_sum2(a, b, scratch, tid, waves: int):
    """Two workgroup sums at once (one barrier pair); ``scratch`` holds >= 2 * waves fp32 slots."""
    a = group_sum(a, WAVE)
    b = group_sum(b, WAVE)
    if waves == 1:
        return a, b
    scratch[tid // WAVE] = a
    scratch[waves + tid // WAVE] = b
    gpu.barrier()
    ta, tb = scratch[0], scratch[waves]
    for w in range_constexpr(1, waves):
        ta = ta + scratch[w]
        tb = tb + scratch[waves + w]
    gpu.barrier()
    return ta, tb


def sigmoid(x):
    return 1.0 / (1.0 + fmath.exp(-x))


def tanh(x):
    """tanh via exp: 1 - 2 / (exp(2x) + 1); exact limits +-1 for large |x| (exp overflows to inf / 0)."""
    return 1.0 - 2.0 / (fmath.exp(x * 2.0) + 1.0)


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    """log(1 + exp(x)) computed as max(x, 0) + log(1 + exp(-|x|))."""
    return fx.max(x, 0.0) + fmath.log(1.0 + fmath.exp(-fmath.absf(x)))


def gated_activation(gate, up, activation: tuple):
    """act(gate) * f(up) in fp32 for ``activation`` = ("situ", beta, linear_beta | None) or ("silu", _, _):
    SiTU: beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb) or u); SiLU: g*sigmoid(g)*u (K3_SPEC section 4)."""
    kind, beta, linear_beta = activation
    if kind == "silu":
        return silu(gate) * up
    g = tanh(gate * (1.0 / beta)) * beta * sigmoid(gate)
    if linear_beta is None:
        return g * up
    return g * (tanh(up * (1.0 / linear_beta)) * linear_beta)


def vector_of(values, dtype):
    return fx.Vector.from_elements(list(values), dtype)


def rmem_of(values, dtype):
    """A register tensor holding ``values`` (already of ``dtype``), e.g. one lane's MFMA operand fragment."""
    values = list(values)
    reg = fx.make_rmem_tensor(len(values), dtype)
    reg.store(fx.Vector.from_elements(values, dtype))
    return reg


def fill_rmem(n: int, value: float):
    reg = fx.make_rmem_tensor(n, fx.Float32)
    reg.store(fx.Vector.filled(n, value, fx.Float32))
    return reg


def kda_log_decay(gate: str, graw, a, bias, lower_bound: float | None):
    """One channel's log-decay from its raw gate input ``graw`` (ops.kda.kda_gate), ``gate`` static: "safe"
    ``L * sigmoid(a (graw + bias))``, "softplus" ``-a * softplus(graw + bias)``, else ``graw`` is the log-decay."""
    if gate == "safe":
        return sigmoid(a * (graw + bias)) * float(lower_bound)
    if gate == "softplus":
        return -a * softplus(graw + bias)
    return graw


class KdaLane(NamedTuple):
    """This lane of a KDA column-pair workgroup: thread id, key channel c, half (:func:`plans.kda_decode_lane`),
    lead (the pair's writing lane), and the workgroup's grid coordinates x (sequence or chunk) and y (head)."""

    tid: object
    c: object
    half: object
    lead: object
    x: object
    y: object


def kda_lane() -> KdaLane:
    tid = gpu.thread_idx.x
    c, half = kda_decode_lane(tid)
    return KdaLane(tid, c, half, half == 0, gpu.block_idx.x, gpu.block_idx.y)

