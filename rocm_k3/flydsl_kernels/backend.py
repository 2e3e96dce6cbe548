"""The ``flydsl`` backend: FlyDSL kernels for AMD Instinct MI300X (gfx942) and MI355X (gfx950).

Chosen automatically on ROCm devices of those two arches when ``flydsl`` imports (first in the ROCm
priority order of ``rocm_k3.ops.registry``). Every kernel is compile-verified for both targets by the
``compile`` test tier (ISA checks) and has host-tested index maps; none has been run on an AMD GPU by
the authors yet — ``pytest -m rocm`` on an MI300X/MI355X is the parity check.

Ops: rms_norm, add_rms_norm, gated_rms_norm, attn_res_step, kda_decode, short_conv, kda_prefill (chunked, C = 64,
three kernels, state walk on bf16 MFMA for bf16 activations and fp32 MFMA otherwise; the recurrent kernel for off-grid
intermediate positions), route and fused_moe (MXFP4 experts, A16W4 and A8W4), situ_and_mul and silu_and_mul (shared
experts, dense layer), mla_prefill (the expanded-heads flash kernel with the fused output gate, for calls whose every
chunk has >= EXPANDED_MIN_QUERIES queries; shorter chunks, mla_decode and mla_write_cache fall through to the next
backend). MoE weights must be prepared once at load time with :func:`prepare_weights`;
``fused_moe`` declines unprepared weights (``supports`` says so) rather than re-laying them per call.
"""

from __future__ import annotations

from rocm_k3.ops import registry
from rocm_k3.ops.devices import AMD_ARCHES, DeviceInfo, device_info
from rocm_k3.ops.moe import ExpertWeights


def kernel_table() -> dict[str, tuple]:
    """op name -> (implementation, supports)."""
    from rocm_k3.flydsl_kernels import mla_ops, moe, ops_impl

    return {
        "rms_norm": (ops_impl.rms_norm, ops_impl.rms_norm_supports),
        "add_rms_norm": (ops_impl.add_rms_norm, ops_impl.add_rms_norm_supports),
        "gated_rms_norm": (ops_impl.gated_rms_norm, ops_impl.gated_rms_norm_supports),
        "attn_res_step": (ops_impl.attn_res_step, ops_impl.attn_res_step_supports),
        "kda_decode": (ops_impl.kda_decode, ops_impl.kda_decode_supports),
        "kda_prefill": (ops_impl.kda_prefill, ops_impl.kda_prefill_supports),
        "short_conv": (ops_impl.short_conv, ops_impl.short_conv_supports),
        "fused_moe": (moe.fused_moe, moe.fused_moe_supports),
        "route": (ops_impl.route, ops_impl.route_supports),
        "situ_and_mul": (ops_impl.situ_and_mul, ops_impl.gated_act_supports),
        "silu_and_mul": (ops_impl.silu_and_mul, ops_impl.gated_act_supports),
        "mla_prefill": (mla_ops.mla_prefill, mla_ops.mla_prefill_supports),
    }


def register() -> None:
    """Register every FlyDSL kernel (raises ImportError when flydsl is not installed)."""
    import flydsl  # noqa: F401  (a missing flydsl makes the registry report the backend unavailable)

    for op, (fn, supports) in kernel_table().items():
        registry.register(op, "flydsl", fn, supports)


def available(dev: DeviceInfo) -> tuple[bool, str]:
    """FlyDSL kernels run on ROCm GPUs of arch gfx942 or gfx950 only."""
    if dev.kind != "rocm":
        return False, f"flydsl kernels need an AMD gfx942/gfx950 GPU under ROCm; this call runs on {dev.describe()}"
    if dev.arch not in AMD_ARCHES:
        return False, f"flydsl kernels target {AMD_ARCHES}; this GPU is {dev.arch}"
    try:
        import flydsl.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - broken ROCm installs raise more than ImportError
        return False, f"flydsl is not importable: {exc}"
    return True, f"flydsl on {dev.describe()}"


def prepare_weights(weights: ExpertWeights, arch: str | None = None) -> ExpertWeights:
    """Checkpoint MXFP4 experts -> ``layout="flydsl"`` (pre-shuffled codes and scales in ``extras``).

    ``arch`` defaults to the arch of the device holding the weights (which must then be a ROCm GPU);
    pass it explicitly to prepare on the host. See :func:`rocm_k3.flydsl_kernels.moe.prepare_weights`.
    """
    from rocm_k3.flydsl_kernels import moe

    if arch is None:
        dev = device_info(weights.device)
        if dev.kind != "rocm":
            raise ValueError(f"prepare_weights: weights are on {dev.describe()}; pass arch='gfx942' or 'gfx950'")
        arch = dev.arch
    return moe.prepare_weights(weights, arch)


def restore_weights(prepared: ExpertWeights) -> ExpertWeights:
    """Exact inverse of :func:`prepare_weights` (checkpoint layout, rebuilt from ``extras``)."""
    from rocm_k3.flydsl_kernels import moe

    return moe.restore_weights(prepared)
