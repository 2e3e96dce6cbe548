"""Cross-compile the warp-specialised Hopper MoE GEMM (``rocm_k3.triton_kernels.moe.gemm_hopper``) for sm_90 and
print a JSON summary ``{"<variant>": {"ok", "error", "mnemonics", "registers", "sass_loops"}}``.

Run by ``tests/test_triton_ops.py`` (compile tier) in a fresh interpreter without ``TRITON_INTERPRET``, like
``triton_compile_driver.py``; the kernel is sm_90 only (wgmma, TMA, setmaxnreg), so AMD targets are not built.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys


def _variants() -> dict:
    """variant -> (constexprs, out type): the two GEMMs as ``fused_moe_with`` launches them (w13 bf16 out, w13 fp32
    out for the A8W4 round trip, w2 fp32 out)."""
    base = dict(ACT=0, HAS_LINEAR_BETA=True, FAST_ACT=True)
    return {"ws_w13": (dict(base, STAGE=1), "*bf16"), "ws_w13_f32out": (dict(base, STAGE=1), "*fp32"),
            "ws_w2": (dict(base, STAGE=2), "*fp32")}


def main() -> None:
    from rocm_k3.triton_kernels.compile_check import compile_kernel, sass_loops
    from rocm_k3.triton_kernels.moe import gemm_hopper as H

    sig = {"codes_desc": f"tensordesc<i64[2, 2, 256],{H.codes_smem_layout()!r}>",
           "scales_desc": f"tensordesc<u8[2, 1, 256],{H.scales_smem_layout()!r}>", "a_ptr": "*bf16",
           "topw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "start_ptr": "*i32",
           "count_ptr": "*i32", "nblk_ptr": "*i32", "n_tiles": "i32", "steps": "i32", "n_out": "i32", "top_k": "i32",
           "stride_a": "i32", "stride_out": "i32", "row_groups": "i32", "beta": "fp32", "linear_beta": "fp32"}
    divisible = ("a_ptr", "out_ptr", "topw_ptr", "sorted_ptr", "block_expert_ptr", "start_ptr", "count_ptr",
                 "nblk_ptr", "stride_a", "stride_out")
    out = {}
    for name, (constexprs, out_ty) in _variants().items():
        try:
            res = compile_kernel(H.moe_gemm_ws_kernel, {**sig, "out_ptr": out_ty},
                                 dict(constexprs, NUM_STAGES=H.STAGES), "sm_90", num_warps=4,
                                 divisible_by_16=divisible, maxnreg=H.MAX_REGISTERS)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[name] = {"ok": False, "error": repr(exc)[-2000:]}
            continue
        loops = sass_loops(res.extra["cubin"])
        # the A operand of the wgmma in registers ({%r..}), not a shared-memory descriptor
        register_a = re.search(r"wgmma\.mma_async[^\n]*\},\s*\{%r", res.asm) is not None
        out[name] = {"ok": True, "error": "", "mnemonics": sorted(res.mnemonics), "registers": res.registers,
                     "register_a": register_a,
                     "sass_loops": None if loops is None else [dataclasses.asdict(lp) for lp in loops]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
