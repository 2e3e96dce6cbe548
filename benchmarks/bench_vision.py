"""Vision tower benchmarks on an NVIDIA GPU: the varlen attention kernel and the whole K3 tower.

Run on the H200: ``PYTHONPATH=. python3 benchmarks/bench_vision.py [--quick]``. One table, median of
``triton.testing.do_bench`` (the tower loops over images on the host, so no CUDA graphs):

- ``varlen_attention`` at K3 shapes (12 heads x 128, bf16) for packed image sets; peer = torch SDPA per image
  (``F.scaled_dot_product_attention``, its flash backend on the H200), plus the Triton tile variants.
  FLOPs = 4 * H * D * sum(L_i^2) (QK^T and PV); bytes = q, k, v read + out written once.
- ``vision_tower`` (27 blocks, 1024 wide, random bf16 weights) + projector: FLOPs = 2 * tower params * patches
  + 2 * projector params * merged tokens + the attention FLOPs; bytes = the bf16 weights read once; the peer is
  the same module with the reference attention backend.
Roofline fractions: bytes / 4.27 TB/s and FLOPs / 778 TFLOP/s (shared/PLATFORM.md) as % of the measured time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from rocm_k3 import ops
from rocm_k3.model.vision.config import K3_VISION_CONFIG, VisionConfig
from rocm_k3.model.vision.model import VisionModel, expected_vision_tensors
from rocm_k3.triton_kernels.vision_attention import varlen_attention_with

HBM_BPS = 4.27e12
BF16_FLOPS = 778e12
IMAGE_SETS = {  # patch grids (h, w): one 1024 x 1024 photo, a screenshot, a page scan, a batch of thumbnails
    "1x 74x74": [(74, 74)],
    "1x 92x164": [(92, 164)],
    "1x 256x180": [(256, 180)],
    "16x 16x16": [(16, 16)] * 16,
    "mixed 4": [(74, 74), (8, 8), (40, 60), (128, 96)],
}


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def report(op: str, shape: str, ms: float, base_ms: float | None, nbytes: float, flops: float, note: str) -> None:
    s = ms * 1e-3
    base = "-" if base_ms is None else f"{base_ms * 1e3:9.1f}us"
    print(f"{op:<18} {shape:<14} {ms * 1e3:9.1f}us  peer {base}  HBM {100 * nbytes / HBM_BPS / s:5.1f}%  "
          f"MMA {100 * flops / BF16_FLOPS / s:5.1f}%  {note}", flush=True)


def bench_attention(quick: bool) -> None:
    heads, dim = 12, 128
    for label, grids in IMAGE_SETS.items():
        lens = [h * w for h, w in grids]
        total = sum(lens)
        q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        splits = [(a, b) for a, b in zip(cu.tolist(), cu.tolist()[1:])]

        def sdpa() -> None:
            for a, b in splits:
                F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1))

        peer = timed(sdpa)
        flops = 4 * heads * dim * sum(n * n for n in lens)
        nbytes = 4 * total * heads * dim * 2
        ms = timed(lambda: ops.varlen_attention(q, k, v, cu, max_seqlen=max(lens), backend="triton"))
        report("varlen_attention", label, ms, peer, nbytes, flops, "triton default tiles; peer = SDPA per image")
        if quick:
            continue
        for bm, bn in ((128, 64), (64, 32), (128, 32)):
            ms = timed(lambda: varlen_attention_with(q, k, v, cu, max_seqlen=max(lens), block_m=bm, block_n=bn))
            report("varlen_attention", label, ms, peer, nbytes, flops, f"tiles {bm}x{bn}")


def bench_tower(quick: bool) -> None:
    cfg = VisionConfig.from_hf_dict(K3_VISION_CONFIG)
    shapes = expected_vision_tensors(cfg)
    def count(prefix: str) -> int:
        return sum(torch.Size(s).numel() for n, s in shapes.items() if n.startswith(prefix) and "pos_emb" not in n)

    tower, projector = count("vision_tower."), count("mm_projector.")
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {n: (torch.randn(s, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    models = {}
    for backend in ("triton", "reference"):
        models[backend] = VisionModel(cfg, backend=backend, device="cuda", dtype=torch.bfloat16)
        models[backend].load_state_dict(tensors)
    for label, grids in list(IMAGE_SETS.items())[: 2 if quick else None]:
        grid_thws = [(1, h, w) for h, w in grids]
        n = sum(h * w for h, w in grids)
        pixels = torch.randn(n, 3, 14, 14, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            peer = timed(lambda: models["reference"](pixels, grid_thws))
            ms = timed(lambda: models["triton"](pixels, grid_thws))
        attn = 4 * 12 * 128 * sum((h * w) ** 2 for h, w in grids) * cfg.num_hidden_layers
        gemm = 2 * tower * n + 2 * projector * n // cfg.merge_area  # the projector runs on merged tokens
        report("vision_tower+proj", label, ms, peer, (tower + projector) * 2, gemm + attn,
               "27 blocks bf16; peer = reference attention")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default tiles only, two image sets for the tower")
    args = parser.parse_args()
    torch.manual_seed(0)
    bench_attention(args.quick)
    bench_tower(args.quick)


if __name__ == "__main__":
    main()
