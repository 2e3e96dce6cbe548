"""The grouped MoE path's ``dequant_kernel`` alone: MXFP4 (``triton`` layout) -> bf16 of all experts, per launch
shape, in GB/s against the measured copy bandwidth.

Shape: the K3-width slice's routed experts (E 32, w13 [2 x 3072, 3584], w2 [3584, 3072]), random codes and scale
bytes 118..125 (the values do not change the work). Each case prints the median time of one ``dequantize`` call
(``triton.testing.do_bench``), the bytes it moves (codes + scales read, bf16 written), GB/s, % of the copy
bandwidth (read + write of a 4 GiB copy) and a checksum of the output bits, so that runs of two checkouts (e.g. main
before a decode change and this branch) can be compared for speed and bit equality:

    PYTHONPATH=<checkout> python benchmarks/bench_dequant.py [--experts 32]

With a checkout whose ``grouped`` has no ``DequantTile`` only its default launch runs.
"""

from __future__ import annotations

import argparse

import torch
import triton

from rocm_k3.ops.moe_types import ExpertDims, ExpertWeights
from rocm_k3.triton_kernels.moe import grouped, layout

TILES = ((2, 4), (2, 8), (2, 16), (4, 8), (4, 16))  # (KU, warps); (2, 4) was the default before 2026-12-04


def _experts(e: int, k: int, n: int, kout: int) -> ExpertWeights:
    def mat(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (e, rows // 64, cols // 128, 2, 128, 16), dtype=torch.uint8, device="cuda")
        scales = torch.randint(118, 126, (e, rows // 64, cols // 128, 32, 8), dtype=torch.uint8, device="cuda")
        return codes, scales

    (w13, s13), (w2, s2) = mat(2 * n, k), mat(kout, n)
    extras = {layout.LAYOUT: layout.TritonExperts(w13, s13, w2, s2, True, True)}
    return ExpertWeights.prepared("mxfp4", layout.LAYOUT, ExpertDims(e, k, n, kout, torch.device("cuda")), extras)


def _copy_bandwidth() -> float:
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    e, k, n, kout = args.experts, 3584, 3072, 3584
    bw = _copy_bandwidth()
    torch.manual_seed(0)
    weights = _experts(e, k, n, kout)
    t = weights.extras[layout.LAYOUT]
    ids = torch.arange(e, dtype=torch.int32, device="cuda")
    tiles = [grouped.DequantTile(*x) for x in TILES] if hasattr(grouped, "DequantTile") else [None]
    default = getattr(grouped, "DEQUANT_TILE", None)
    print(f"dequant E {e} w13 [{2 * n}, {k}] w2 [{kout}, {n}]; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    for which, shape, codes, scales in (("w13", (2 * n, k), t.w13, t.w13_s), ("w2", (kout, n), t.w2, t.w2_s)):
        out = torch.empty(e, *shape, dtype=torch.bfloat16, device="cuda")
        moved = out.numel() * 2 + codes.numel() + scales.numel()
        for tile in tiles:
            extra = () if tile is None else (tile,)
            out.fill_(float("nan"))
            grouped.dequantize(weights, which, ids, out, *extra)
            words = out.view(torch.int64).reshape(-1)  # 4 bf16 per word; the products wrap (a hash, not a sum)
            checksum = int((words * (torch.arange(words.numel(), device="cuda") % 65521 + 1)).sum()) & (2 ** 48 - 1)
            ms = triton.testing.do_bench(lambda: grouped.dequantize(weights, which, ids, out, *extra), warmup=10,
                                         rep=100, return_mode="median")
            name = "default" if tile is None else f"KU {tile.ku} warps {tile.num_warps}"
            mark = " (default)" if tile is not None and tile == default else ""
            print(f"  {which} {name:>16}: {ms:.3f} ms, {moved / ms / 1e6:,.0f} GB/s, "
                  f"{100 * moved / ms / 1e-3 / bw:.0f} % of copy, NaN {bool(out.isnan().any())}, "
                  f"checksum {checksum:012x}{mark}", flush=True)
        del out


if __name__ == "__main__":
    main()
