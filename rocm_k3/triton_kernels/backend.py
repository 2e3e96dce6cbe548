"""The ``triton`` backend: registers every Triton kernel with the op registry.

Each kernel module exposes ``KERNELS = {op_name: (fn, supports_fn)}`` with ``fn`` taking the op's public signature
minus ``backend``. Modules (imported by :func:`register`, never at import time):
``norm`` (rms_norm, add_rms_norm, gated_rms_norm), ``attn_res`` (attn_res_mix, attn_res_step), ``moe``
(fused_moe, route, situ_and_mul, silu_and_mul), ``mla_decode`` (mla_decode), ``mla_prefill`` (mla_prefill,
mla_write_cache), ``kda`` (the KDA kernels) and ``vision_attention`` (varlen_attention, the vision tower's attention). The quant ops have no Triton kernel (they run at load time). When two modules offer the same op the
first in ``KERNEL_MODULES`` wins (so ``gated_rms_norm`` comes from ``norm``).

MoE weights: the kernels read the checkpoint byte layout, so :func:`prepare_weights` (call it once at load) only
makes the tensors contiguous and tags ``layout="triton"``; unprepared weights are prepared lazily on their first
``fused_moe`` call and cached in ``weights.extras`` (see :mod:`rocm_k3.triton_kernels.moe.fused`).
"""

from __future__ import annotations

import importlib

from rocm_k3.ops import registry
from rocm_k3.ops.devices import DeviceInfo
from rocm_k3.ops.moe import ExpertWeights

KERNEL_MODULES = (
    "rocm_k3.triton_kernels.norm",
    "rocm_k3.triton_kernels.attn_res",
    "rocm_k3.triton_kernels.moe",
    "rocm_k3.triton_kernels.mla_decode",
    "rocm_k3.triton_kernels.mla_prefill",
    "rocm_k3.triton_kernels.kda",
    "rocm_k3.triton_kernels.vision_attention",
)


def kernel_table() -> dict[str, tuple]:
    """op name -> (fn, supports) over all kernel modules (first module wins on a duplicate)."""
    table: dict[str, tuple] = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for op, entry in module.KERNELS.items():
            table.setdefault(op, entry)
    return table


def register() -> None:
    """Register every Triton kernel with its ``supports`` check (raises ImportError without triton)."""
    import triton  # noqa: F401  (a missing triton makes the registry report the backend unavailable)

    for op, (fn, supports) in kernel_table().items():
        registry.register(op, "triton", fn, supports)


def available(dev: DeviceInfo) -> tuple[bool, str]:
    """Triton runs on NVIDIA and AMD GPUs; on the CPU the interpreter is for tests only."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return False, f"triton is not importable: {exc}"
    if dev.kind not in ("cuda", "rocm"):
        return False, "triton needs a GPU; under TRITON_INTERPRET the tests call the kernels directly"
    return True, f"triton on {dev.describe()}"


def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
    """Checkpoint-layout experts -> ``layout="triton"`` (what ``fused_moe`` on this backend accepts).

    The kernels read the checkpoint byte order directly (MXFP4 packed along K, low nibble first, E8M0 per 32);
    this makes the tensors contiguous and tags the layout. Idempotent. Optional: ``fused_moe`` prepares
    unprepared weights lazily, once.
    """
    from rocm_k3.triton_kernels.moe.fused import prepare_weights as _prepare

    return _prepare(weights)
