"""Correctness and time of each fused-MoE variant at K3 decode shapes on a CUDA GPU (a triage tool).

``PYTHONPATH=. python3 benchmarks/moe_variants.py``: for T in (1, 16) prints the relative error of every
(tile config, weight decode) variant against the fp32 reference, and its median time.
"""

from __future__ import annotations

import torch
import triton.testing

from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.ops.moe_reference import fused_moe_reference
from rocm_k3.triton_kernels.moe.fused import MoEConfig, fused_moe_with, prepare_weights


def main() -> None:
    dev = "cuda"
    e, k, hidden, n = 128, 16, 3584, 3072
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randint(0, 256, (e, 2 * n, hidden // 2), dtype=torch.uint8, device=dev, generator=g)
    w2 = torch.randint(0, 256, (e, hidden, n // 2), dtype=torch.uint8, device=dev, generator=g)
    s13 = torch.randint(118, 123, (e, 2 * n, hidden // 32), dtype=torch.uint8, device=dev, generator=g)
    s2 = torch.randint(118, 123, (e, hidden, n // 32), dtype=torch.uint8, device=dev, generator=g)
    weights = prepare_weights(ExpertWeights("mxfp4", w13, s13, w2, s2))
    variants = [(MoEConfig(16, 32, 64, 4, 1), "dot_scaled"), (MoEConfig(16, 64, 128, 8, 1), "dot_scaled"),
                (MoEConfig(16, 32, 64, 4, 1), "manual"), (MoEConfig(16, 64, 128, 8, 3), "manual"),
                (MoEConfig(16, 32, 64, 4, 1), "bits"), (MoEConfig(16, 64, 128, 8, 3), "bits"),
                (MoEConfig(16, 64, 256, 4, 3), "bits"), (MoEConfig(64, 128, 128, 8, 1), "dot_scaled")]
    for t in (1, 16):
        ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].to(torch.int32)
        tw = torch.softmax(torch.randn(t, k, device=dev), dim=1)
        x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
        ref = fused_moe_reference(x, weights, tw, ids, activation=MoEActivation()).float()
        for cfg, decode in variants:
            label = f"T{t} BM{cfg.block_m} BN{cfg.block_n} BK{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {decode}"
            try:
                out = fused_moe_with(x, weights, tw, ids, config=cfg, w4_decode=decode).float()
                err = ((out - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench_cudagraph(lambda: fused_moe_with(x, weights, tw, ids, config=cfg,
                                                                               w4_decode=decode), rep=50)
                print(f"{label}: rel_err {err:.3e}  {ms * 1e3:.1f} us", flush=True)
            except Exception as exc:  # report and continue with the next variant
                print(f"{label}: FAILED {exc!r}"[:400], flush=True)


if __name__ == "__main__":
    main()
