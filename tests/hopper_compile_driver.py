"""Cross-compile the warp-specialised Hopper MoE GEMM (``rocm_k3.triton_kernels.moe.gemm_hopper``) for sm_90 and
print a JSON summary ``{"<variant>": {"ok", "error", "mnemonics", "registers", "sass_loops"}}``.

Run by ``tests/kernels/triton/test_triton_ops.py`` (compile tier) in a fresh interpreter without ``TRITON_INTERPRET``, like
``triton_compile_driver.py``; the kernel is sm_90 only (wgmma, TMA, setmaxnreg), so AMD targets are not built.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys


def _variants() -> dict:
    """variant -> (constexprs, out type, block rows[, wide]): the two GEMMs as ``fused_moe_with``
    launches them (w13 bf16 out, w13 rounded through MXFP8 for A8W4, w2 fp32 out) at 16-row blocks, at the prefill
    blocks (32, 64, 128 rows), w2 in two K parts, and 256-row weight tiles at 32 / 64-row blocks (``wide``:
    ``gemm_hopper.wide_config``)."""
    base = dict(ACT=0, HAS_LINEAR_BETA=True, FAST_ACT=True, SPLIT=1, OUT_MX=False, EMAX=8, BIAS=7, FP8_MAX=448.0)
    return {"ws_w13": (dict(base, STAGE=1), "*bf16", 16), "ws_w13_mx": (dict(base, STAGE=1, OUT_MX=True), "*bf16", 16),
            "ws_w2": (dict(base, STAGE=2), "*fp32", 16), "ws_w13_bm32": (dict(base, STAGE=1), "*bf16", 32),
            "ws_w13_bm64": (dict(base, STAGE=1), "*bf16", 64), "ws_w2_bm64": (dict(base, STAGE=2), "*fp32", 64),
            "ws_w2_split2": (dict(base, STAGE=2, SPLIT=2), "*fp32", 16),
            "ws_w13_bm128": (dict(base, STAGE=1), "*bf16", 128), "ws_w2_bm128": (dict(base, STAGE=2), "*fp32", 128),
            "ws_w13_bm64_t256": (dict(base, STAGE=1), "*bf16", 64, True),
            "ws_w2_bm64_t256": (dict(base, STAGE=2), "*fp32", 64, True),
            "ws_w13_bm32_t256": (dict(base, STAGE=1, OUT_MX=True), "*bf16", 32, True),
            "ws_w2_bm32_t256": (dict(base, STAGE=2), "*fp32", 32, True)}



def main() -> None:
    from rocm_k3.triton_kernels.compile_check import compile_kernel, sass_loops
    from rocm_k3.triton_kernels.moe import gemm_hopper as H

    sig = {"a_ptr": "*bf16",
           "topw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "start_ptr": "*i32",
           "count_ptr": "*i32", "nblk_ptr": "*i32", "n_tiles": "i32", "steps": "i32", "n_out": "i32", "top_k": "i32",
           "stride_a": "i32", "stride_out": "i32", "stride_split": "i32", "row_groups": "i32", "beta": "fp32", "linear_beta": "fp32"}
    divisible = ("a_ptr", "out_ptr", "topw_ptr", "sorted_ptr", "block_expert_ptr", "start_ptr", "count_ptr",
                 "nblk_ptr", "stride_a", "stride_out")
    out = {}
    for name, (constexprs, out_ty, block_m, *wide) in _variants().items():
        cfg = H.wide_config(block_m) if wide else H.default_config(block_m)
        g = cfg.groups
        descs = {"codes_desc": f"tensordesc<i64[{g}, 2, 256],{H.codes_smem_layout()!r}>",
                 "scales_desc": f"tensordesc<u8[{g}, 1, 256],{H.scales_smem_layout()!r}>"}
        try:
            res = compile_kernel(H.moe_gemm_ws_kernel, {**descs, **sig, "out_ptr": out_ty},
                                 dict(constexprs, BM=block_m, NUM_STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs,
                                      PDL=cfg.pdl, GROUPS=g), "sm_90", num_warps=4, divisible_by_16=divisible,
                                 maxnreg=cfg.max_registers)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[name] = {"ok": False, "error": repr(exc)[-2000:]}
            continue
        loops = sass_loops(res.extra["cubin"])
        # the A operand of the wgmma in registers ({%r..}), not a shared-memory descriptor
        register_a = re.search(r"wgmma\.mma_async[^\n]*\},\s*\{%r", res.asm) is not None
        out[name] = {"ok": True, "error": "", "mnemonics": sorted(res.mnemonics), "registers": res.registers,
                     "groups": g, "spills": res.spills, "scratch": res.scratch_bytes,
                     "register_a": register_a, "block_m": block_m, "shared": res.shared_bytes,
                     "shared_estimate": cfg.shared_bytes(),
                     "sass_loops": None if loops is None else [dataclasses.asdict(lp) for lp in loops]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
