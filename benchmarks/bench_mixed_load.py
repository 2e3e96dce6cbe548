"""Decode smoothness under prefill load: inter-token latency of running decodes while long prompts arrive, per
``--long-prefill-token-threshold`` (vLLM's flag; 0 = no cap), and the long prompts' time to first token.

    PYTHONPATH=. python3 benchmarks/bench_mixed_load.py [--decodes 16] [--long-prompts 8] [--long-len 3968]
        [--configs 4096:0 4096:512 1024:0 1024:256 512:256] [--width 1]   # GPU: the K3-width slice, Triton
    PYTHONPATH=. python3 benchmarks/bench_mixed_load.py --cpu        # CPU: the embedded model, small sizes

Each config is ``max_num_batched_tokens:long_prefill_token_threshold``. Before timing, one long prompt is
prefilled alone (the prefill kernels compiled and tuned for the chunk shapes). ``--decodes`` requests (64-token
prompts) are prefilled and decode; then ``--long-prompts`` prompts of
``--long-len`` tokens (sharing no prefix) arrive at once. Every engine step carries every running decode (decodes
first), so a step's wall time is the inter-token latency (ITL) of each decode in it. Timed: the steps from the
arrival of the long prompts until the last of them has sampled its first token, plus as many pure-decode steps
before the arrival. Printed per threshold: ITL p50 / p99 / max, p99 / p50, the long prompts' mean and last time to
first token, and the prefill tokens per second. Performance is printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import ensure_embedded_model, k3_slice_overrides, write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams


# The GPU load (the K3 slice has 4k positions), also bench_e2e.py --prefill's mixed-load line.
GPU_LOAD = dict(decodes=16, long_prompts=8, long_len=3968, steady_steps=24)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(llm: LLM, args: argparse.Namespace, device: str) -> dict:
    core = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = llm.vocab_size
    decode = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(args.decodes):
        core.add_request(f"d{i}", torch.randint(1, vocab, (64,), generator=gen).tolist(), decode)
    while any(not s.is_decoding for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    warm = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core.add_request("warm", torch.randint(1, vocab, (args.long_len,), generator=gen).tolist(), warm)
    while core.scheduler.waiting or any(not s.is_decoding for s in core.scheduler.running):
        core.step()  # the long prompt's chunks (kernels compiled for these shapes) beside the decodes
    for _ in range(3):
        core.step()  # warm-up decode steps
    steady: list[float] = []
    for _ in range(args.steady_steps):
        _sync(device)
        t0 = time.perf_counter()
        core.step()
        _sync(device)
        steady.append(time.perf_counter() - t0)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    longs = {f"L{i}" for i in range(args.long_prompts)}
    for rid in sorted(longs):
        core.add_request(rid, torch.randint(1, vocab, (args.long_len,), generator=gen).tolist(), first)
    mixed: list[float] = []
    ttft: dict[str, float] = {}
    _sync(device)
    arrival = time.perf_counter()
    while len(ttft) < len(longs):
        t0 = time.perf_counter()
        outputs = core.step()
        _sync(device)
        now = time.perf_counter()
        mixed.append(now - t0)
        for delta in outputs:
            if delta.request_id in longs and delta.request_id not in ttft:
                if delta.error:
                    raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                ttft[delta.request_id] = now - arrival
    itl = steady + mixed
    p50, p99 = _percentile(itl, 0.5), _percentile(itl, 0.99)
    return {"p50": p50 * 1e3, "p99": p99 * 1e3, "max": max(itl) * 1e3, "ratio": p99 / p50,
            "ttft_mean": statistics.mean(ttft.values()) * 1e3, "ttft_last": max(ttft.values()) * 1e3,
            "prefill_tok_s": args.long_prompts * args.long_len / max(ttft.values()), "mixed_steps": len(mixed)}


def gpu_engine_args(dtype: str) -> dict:
    """The LLM arguments of the GPU runs (Triton backend, 8 GiB of MLA cache, 16 GiB of KDA state)."""
    return dict(dtype=dtype, backend="triton", device="cuda", kv_cache_bytes=8 << 30, state_cache_bytes=16 << 30)


def measure(path: Path, budget: int, threshold: int, args: argparse.Namespace, device: str, kw: dict) -> dict:
    """:func:`run` on a fresh engine at ``max_num_batched_tokens`` = budget and ``long_prefill_token_threshold`` =
    threshold (``kw``: the other LLM arguments), shut down and freed afterwards."""
    llm = LLM(path, max_num_seqs=args.decodes + args.long_prompts, max_num_batched_tokens=budget,
              max_model_len=args.long_len + 64, long_prefill_token_threshold=threshold, **kw)
    try:
        return run(llm, args, device)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the embedded model on the CPU (small default sizes)")
    ap.add_argument("--decodes", type=int, default=None)
    ap.add_argument("--long-prompts", type=int, default=None)
    ap.add_argument("--long-len", type=int, default=None)
    ap.add_argument("--configs", nargs="+", default=None,
                    help="max_num_batched_tokens:long_prefill_token_threshold pairs")
    ap.add_argument("--steady-steps", type=int, default=None)
    ap.add_argument("--width", type=int, default=1, help="divide the K3 slice's widths (GPU)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    small = dict(decodes=4, long_prompts=2, long_len=1024, configs=["1024:0", "1024:256"], steady_steps=8)
    large = dict(GPU_LOAD, configs=["4096:0", "4096:512", "1024:0", "1024:256", "512:256"])
    for key, value in (small if cpu else large).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cpu:
        path, device, kw = ensure_embedded_model(), "cpu", dict(dtype="float32", backend="reference")
        what = "embedded tiny K3, float32, reference backend, CPU"
    else:
        path = Path(tempfile.mkdtemp()) / "k3-slice"
        write_tiny_checkpoint(path, text_overrides=k3_slice_overrides(args.width))
        device = "cuda"
        kw = gpu_engine_args(args.dtype)
        what = f"K3 slice (width 1/{args.width}), {args.dtype}, Triton backend, {torch.cuda.get_device_name()}"
    print(f"{what}: {args.decodes} decodes, {args.long_prompts} prompts of {args.long_len} tokens arrive")
    print(f"{'budget':>6} | {'threshold':>9} | {'ITL p50':>8} | {'ITL p99':>8} | {'ITL max':>8} | {'p99/p50':>7} | "
          f"{'TTFT mean':>9} | {'TTFT last':>9} | {'prefill tok/s':>13} | steps")
    for config in args.configs:
        budget, threshold = (int(x) for x in config.split(":"))
        r = measure(path, budget, threshold, args, device, kw)
        print(f"{budget:>6} | {threshold:>9} | {r['p50']:>5.1f} ms | {r['p99']:>5.1f} ms | {r['max']:>5.1f} ms | "
              f"{r['ratio']:>7.2f} | {r['ttft_mean']:>6.0f} ms | {r['ttft_last']:>6.0f} ms | "
              f"{r['prefill_tok_s']:>13.0f} | {r['mixed_steps']}", flush=True)


if __name__ == "__main__":
    main()
