"""Benchmarks of the Triton kernels on an NVIDIA GPU against torch baselines and the H200 roofline.

Run on the H200: ``PYTHONPATH=. python3 benchmarks/bench_ops.py [--out DIR] [--quick]``. Prints one table:
op, shape, kernel time (median of CUDA-graph replays), baseline time, bytes and FLOPs counted as the fewest the op
must move/do, and the roofline fractions ``bytes / 4.27 TB/s`` and ``FLOPs / 778 TFLOP/s`` (measured ceilings,
shared/PLATFORM.md) expressed as % of the measured time.

- The MoE (decode and prefill, against OpenAI's triton_kernels) has its own script: ``benchmarks/bench_moe.py``.
- AttnRes step: bytes = (num_blocks + 2) reads + 3 writes of [T, Hd] bf16; baseline = the unfused torch reference.
  Without ``--quick`` AttnRes sweeps its launch variants (rows, warps, prefetch).
- MLA decode: bytes = N * L * 576 * 2 (latent cache) + q/out; baseline = torch reference (gather + softmax).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton.testing

from rocm_k3.ops import attn_res as ref_attn_res
from rocm_k3.ops import mla as ref_mla
from rocm_k3.triton_kernels import attn_res as tri_attn_res
from rocm_k3.triton_kernels.mla_decode import mla_decode_with

HBM_BPS = 4.27e12
BF16_FLOPS = 778e12
ROWS: list[dict] = []


def timed(fn, graph: bool = True) -> float:
    """Median milliseconds; CUDA-graph replays when ``graph`` (launch gaps removed, as the engine will run)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def record(op: str, shape: str, ms: float, base_ms: float | None, nbytes: float, flops: float, note: str = "") -> None:
    s = ms * 1e-3
    row = dict(op=op, shape=shape, ms=ms, baseline_ms=base_ms, bytes=nbytes, flops=flops,
               hbm_pct=100 * nbytes / HBM_BPS / s, flop_pct=100 * flops / BF16_FLOPS / s,
               speedup=(base_ms / ms) if base_ms else None, note=note)
    ROWS.append(row)
    print(f"{op:<14} {shape:<34} {ms * 1e3:9.1f}us  base {'-' if base_ms is None else f'{base_ms * 1e3:9.1f}us'}"
          f"  HBM {row['hbm_pct']:5.1f}%  MMA {row['flop_pct']:5.1f}%  {note}", flush=True)


ATTN_RES_SWEEP = [None, tri_attn_res.AttnResConfig(1, 16, False), tri_attn_res.AttnResConfig(1, 8, True),
                  tri_attn_res.AttnResConfig(1, 8, False), tri_attn_res.AttnResConfig(1, 32, True),
                  tri_attn_res.AttnResConfig(2, 16, True), tri_attn_res.AttnResConfig(1, 4, True)]


def bench_attn_res(dev: str, quick: bool) -> None:
    hd, b_max, nb = 7168, 9, 8
    for t in (1, 64, 4096):
        p = torch.randn(t, hd, device=dev, dtype=torch.bfloat16)
        d = torch.randn_like(p)
        blocks = torch.randn(b_max, t, hd, device=dev, dtype=torch.bfloat16)
        w = [torch.randn(hd, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        kw = dict(write_block=True, proj_weight=w[0], norm_weight=w[1], rms_weight=w[2])
        nbytes = (nb + 2) * t * hd * 2 + 3 * t * hd * 2
        base = timed(lambda: ref_attn_res._attn_res_step_reference(p, d, blocks, nb, **kw), graph=False)
        for cfg in ATTN_RES_SWEEP[:1] if quick else ATTN_RES_SWEEP:
            ms = timed(lambda: tri_attn_res.attn_res_step_with(p, d, blocks, nb, config=cfg, **kw))
            label = str(cfg or f"default {tri_attn_res.default_config(hd)}")
            record("attn_res_step", f"T{t} Hd{hd} blocks{nb} +write", ms, base, nbytes, 0.0, label)


def bench_mla(dev: str) -> None:
    bs = 64
    for n, h, length in ((1, 96, 8192), (32, 12, 4096), (32, 96, 4096), (128, 12, 2048)):
        blocks_per = math.ceil(length / bs)
        cache = torch.randn(n * blocks_per, bs, 576, device=dev, dtype=torch.bfloat16)
        bt = torch.randperm(n * blocks_per, device=dev).view(n, blocks_per).to(torch.int32)
        lens = torch.full((n,), length, device=dev, dtype=torch.int32)
        q = torch.randn(n, h, 512, device=dev, dtype=torch.bfloat16)
        qp = torch.randn(n, h, 64, device=dev, dtype=torch.bfloat16)
        nbytes = n * length * 576 * 2 + 2 * n * h * (512 + 64) * 2
        flops = 2 * n * h * length * (576 + 512)
        base = timed(lambda: ref_mla._mla_decode_reference(q, qp, cache, bt, lens, scale=0.072), graph=False) \
            if n <= 32 else None
        ms = timed(lambda: mla_decode_with(q, qp, cache, bt, lens, scale=0.072))
        record("mla_decode", f"N{n} H{h} L{length} bs{bs}", ms, base, nbytes, flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_ops.json here")
    parser.add_argument("--quick", action="store_true", help="defaults only: skip the AttnRes sweep")
    parser.add_argument("--only", choices=("attn_res", "mla"), action="append", help="run these sections")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops.py needs a CUDA GPU")
    dev = "cuda"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for name, fn in (("attn_res", lambda: bench_attn_res(dev, args.quick)), ("mla", lambda: bench_mla(dev))):
        if args.only and name not in args.only:
            continue
        try:
            fn()
        except Exception as exc:  # keep the other sections' numbers
            print(f"{name} benchmark failed: {exc!r}", flush=True)
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_ops.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
