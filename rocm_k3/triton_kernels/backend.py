"""The ``triton`` backend: registers every Triton kernel with the op registry.

Each kernel module exposes ``KERNELS = {op_name: (fn, supports_fn)}`` with ``fn`` taking the op's public signature
minus ``backend``. Modules (imported by :func:`register`, never at import time):
``norm`` (rms_norm, add_rms_norm, gated_rms_norm), ``attn_res`` (attn_res_mix, attn_res_step), ``moe``
(fused_moe, route, situ_and_mul, silu_and_mul), ``mla_decode`` (mla_decode), ``mla_prefill`` (mla_prefill,
mla_write_cache), ``kda`` (the KDA kernels) and ``vision_attention`` (varlen_attention, the vision tower's attention). The quant ops have no Triton kernel (they run at load time). When two modules offer the same op the
first in ``KERNEL_MODULES`` wins (so ``gated_rms_norm`` comes from ``norm``).

MoE weights: :func:`prepare_weights` (call it once at load) re-lays MXFP4 experts into the ``triton`` layout of
:mod:`rocm_k3.triton_kernels.moe.layout` and keeps only those tensors (the experts sit in memory once; the reference
still runs them expert by expert); bf16 experts stay in checkpoint layout. Unprepared weights are prepared lazily on
their first ``fused_moe`` call and cached in ``weights.extras`` (a second copy: prepare at load time instead).
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
    """Experts in any layout -> ``layout="triton"`` (what ``fused_moe`` on this backend reads; see the module doc).

    Idempotent. Optional: ``fused_moe`` prepares unprepared weights lazily, once (keeping a second copy).
    """
    from rocm_k3.triton_kernels.moe.fused import prepare_weights as _prepare

    return _prepare(weights)
