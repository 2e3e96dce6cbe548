"""How much of the MoE GEMMs' time is the MXFP4 decode? The op with (part of) the decode removed, on the H200.

Run on the GPU, one process per variant (the variant replaces the decode's inline PTX before anything compiles)::

    PYTHONPATH=. python3 benchmarks/bench_moe_ablation.py {full,noscale,nodecode} [--tokens 16 64 512] [--gemm triton]

- ``full``: the op as it ships (the reference row of the ablation);
- ``noscale``: the 9 integer ops of the unpack only, no bf16x2 scale multiply (wrong values, same bytes moved);
- ``nodecode``: the code words fed to the MMA as they are (no decode at all: what the loads, the pipeline, the
  MMA and the epilogue cost on their own).

The variant changes :data:`rocm_k3.triton_kernels.moe.decode.ASM_FOLD`, which both GEMM kernels decode with
(``moe_gemm_kernel`` and, at 16-row blocks, the warp-specialised Hopper kernel the op picks by default; ``--gemm
triton`` measures ``moe_gemm_kernel`` there). The outputs of ``noscale`` / ``nodecode`` are garbage by design; only
the times mean something. Shapes, routing,
bytes and the % of HBM as in ``bench_moe.py``; per T: the whole op's CUDA-graph median, the eager per-kernel times
(torch.profiler) with the w13 / w2 GEMMs' own % of HBM (their share of the bytes, 2/3 and 1/3), and the SM clock,
memory clock and power that ``nvidia-smi`` sampled during the graph timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("full", "noscale", "nodecode")


def _patch_decode(variant: str) -> None:
    from rocm_k3.triton_kernels.moe import decode

    if variant == "noscale":
        decode.ASM_FOLD = tl.constexpr("{" + decode._UNPACK + "}")
    elif variant == "nodecode":
        decode.ASM_FOLD = tl.constexpr("{ mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4; }")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 512])
    parser.add_argument("--gemm", choices=("ws", "triton"), default=None, help="fused_moe_with's gemm (default: auto)")
    args = parser.parse_args()
    _patch_decode(args.variant)  # before the kernels compile (the bench's experts are FOLD: every scale <= 128)

    import torch

    import bench_moe as B
    from rocm_k3.triton_kernels.moe.fused import prepare_weights

    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_ablation.py needs a CUDA GPU")
    w = B.experts("cuda")
    prepared = prepare_weights(w)
    del w
    fn = B.ours(prepared, "bf16", None, gemm=args.gemm)
    for t in args.tokens:
        x = torch.randn(t, B.HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits, ids = B.routing_inputs(t, "cuda")
        floor_us = torch.unique(ids).numel() * B.EXPERT_BYTES / B.HBM_BPS * 1e6
        kernels = B.kernel_times(fn, (x, logits, ids))
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader",
                                "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            us = B.timed(lambda: fn(x, logits, ids)) * 1e3
        finally:
            smi.terminate()
        samples = smi.communicate()[0].strip().splitlines()
        w13 = next(v for k, v in kernels.items() if k.endswith(" w13"))
        w2 = next(v for k, v in kernels.items() if k.endswith(" w2"))
        row = dict(variant=args.variant, tokens=t, floor_us=round(floor_us, 1), graph_us=round(us, 1),
                   hbm_pct=round(100 * floor_us / us, 1), w13_hbm_pct=round(100 * floor_us * 2 / 3 / w13, 1),
                   w2_hbm_pct=round(100 * floor_us / 3 / w2, 1),
                   kernels_us={k: round(v, 1) for k, v in kernels.items()}, nvidia_smi=samples[-4:])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
