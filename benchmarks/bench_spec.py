"""Speculative decoding: tokens/s and TPOT with and without speculation (n-gram prompt lookup and the embedded
hidden-state drafter) at batch 1, 8, 32, on the CPU or a GPU.

Run: ``PYTHONPATH=. python benchmarks/bench_spec.py [--batches 1 8 32] [--k 3] [--max-tokens 64]
[--methods ngram draft_model] [--workloads repetitive plain] [--device cpu|cuda] [--model tiny|k3-slice]
[--slice-width N] [--dtype D] [--backend B] [--enforce-eager] [--json OUT]``. Defaults: the embedded tiny K3
(fp32, reference ops on the CPU, one intra-op thread); the drafter is ``embedded-drafter`` (trained for the tiny K3,
so ``--model k3-slice``, the K3-width 4-layer slice of ``k3_slice_overrides()`` with seeded random weights, runs
n-gram only). On a GPU the engines capture decode graphs (speculation: one per batch bucket and 1 + k) unless
``--enforce-eager``; the buckets are ``graph_buckets(max(--batches))``, so one ``--batches`` value per process keeps
a K3-width run's compiles and captures to that batch's buckets (``scripts/h200_pending.sh``; a written
``--slice-dir`` is reused). Each engine's build time is printed as it finishes. Workloads: ``repetitive``
(prompts that repeat a phrase, where prompt lookup finds drafts) and ``plain`` (short natural prompts). The baseline is this engine decoding one token per step (the peer
stacks' K3 numbers need a whole K3 and are out of reach here); every fp32 speculative run is checked to produce the
baseline's greedy tokens (``same tokens``: requests whose tokens match it; in bf16 near-ties may flip). TPOT = (finish - first token) / (tokens - 1) per request, averaged; tokens/s =
generated tokens / wall time of the whole batch (prefill included). ``floor ms``: the model's weight bytes over
4.27 TB/s (H200 HBM), the memory-bound time of one decode step; a speculative step's floor TPOT is that over the
mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import k3_slice_overrides, write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER
from rocm_k3.worker.cuda_graph import graph_buckets

REPETITIVE = ["hello hello hello hello hello hello", "def f(x):\n    return x\ndef f(x):\n    return x\n",
              "1 2 3 4 5 6 7 8 9 10 11 12", "The the the the the the the the"]
PLAIN = ["The file", "Return the number of", "If the value is", "A list of"]
HBM = 4.27e12  # bytes/s, the H200's measured device-copy ceiling (shared/PLATFORM.md)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=["ngram", "draft_model"], choices=["ngram", "draft_model"])
    p.add_argument("--workloads", nargs="+", default=["repetitive", "plain"], choices=["repetitive", "plain"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--model", default="tiny", choices=["tiny", "k3-slice"])
    p.add_argument("--slice-width", type=int, default=1, help="k3-slice widths divided by this (plumbing runs)")
    p.add_argument("--slice-dir", type=Path, default=Path("/tmp/rocm-k3-bench-spec-slice"))
    p.add_argument("--dtype", default=None, help="default: float32 (tiny), bfloat16 (k3-slice)")
    p.add_argument("--backend", default=None, help="default: reference on the CPU, triton on a GPU")
    p.add_argument("--enforce-eager", action="store_true", help="no decode graphs on a GPU")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def run(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", llm.tokenizer.encode(prompt), params)
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int]]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for d in engine.step():
            now = time.perf_counter()
            if d.new_token_ids and d.request_id not in first:
                first[d.request_id] = now
            if d.finished:
                done[d.request_id] = (now, d.output.token_ids)
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for _, t in done.values())
    tpot = sum((end - first[r]) / max(1, len(t) - 1) for r, (end, t) in done.items()) / len(done)
    after = engine.stats()
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    return {"tokens_per_s": tokens / wall, "tpot_ms": 1e3 * tpot, "wall_s": wall,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens": {r: t for r, (_, t) in sorted(done.items())}}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM() arguments shared by the baseline and the speculative engines."""
    cpu = args.device == "cpu"
    kw = {"device": args.device, "max_num_seqs": max(args.batches), "max_model_len": 512,
          "backend": args.backend or ("reference" if cpu else "triton"), "enforce_eager": args.enforce_eager,
          "dtype": args.dtype or ("float32" if args.model == "tiny" else "bfloat16")}
    if not cpu:  # several engines share the GPU: fixed cache budgets instead of a memory fraction each
        kw.update(kv_cache_bytes=1 << 30, state_cache_bytes=1 << 30)
    if args.model == "k3-slice":
        if "draft_model" in args.methods:
            raise SystemExit("--model k3-slice: the embedded drafter is trained for the tiny K3; use --methods ngram")
        if not (args.slice_dir / "config.json").is_file():
            write_tiny_checkpoint(args.slice_dir, text_overrides=k3_slice_overrides(args.slice_width))
        kw["path"] = args.slice_dir
    return kw


def build(common: dict, **extra) -> LLM:
    """One engine, its build time printed as it finishes (a run cut short still shows where its time went)."""
    t0 = time.perf_counter()
    llm = LLM(**common, **extra)
    graphs = llm.engine.executor.worker.runner.graphs
    print(f"built {extra.get('speculative_config', {}).get('method', 'baseline')} engine in "
          f"{time.perf_counter() - t0:.1f} s (max_num_seqs {common['max_num_seqs']}, decode graph batch buckets "
          f"{'off' if graphs is None else graph_buckets(common['max_num_seqs'])})", flush=True)
    return llm


def floor_ms(llm: LLM) -> float:
    """Weight bytes of the served model over the H200's HBM bandwidth, in ms (one memory-bound decode step)."""
    model = llm.engine.executor.worker.model
    return 1e3 * sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / HBM


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    common = engine_kwargs(args)
    engines = {"off": build(common)}
    for method in args.methods:
        spec = {"method": method, "num_speculative_tokens": args.k}
        if method == "draft_model":
            spec["model"] = EMBEDDED_DRAFTER
        engines[method] = build(common, speculative_config=spec)
    floor = floor_ms(engines["off"])
    graphs = engines["off"].engine.executor.worker.runner.graphs
    print(f"model {args.model} ({common['dtype']}, {common['backend']}) on {args.device}, k={args.k}, "
          f"decode graphs {'on' if graphs is not None else 'off'}, floor {floor:.3f} ms per decode step", flush=True)
    rows = []
    print(f"{'workload':<11}{'method':<12}{'batch':>6}{'base tok/s':>12}{'spec tok/s':>12}{'speedup':>9}"
          f"{'base TPOT ms':>14}{'spec TPOT ms':>14}{'accept len':>12}{'accept rate':>13}{'floor TPOT ms':>15}{'same tokens':>13}", flush=True)
    for workload in args.workloads:
        base_prompts = REPETITIVE if workload == "repetitive" else PLAIN
        for batch in args.batches:
            prompts = [base_prompts[i % len(base_prompts)] + f" {i}" * (i // len(base_prompts))
                       for i in range(batch)]
            for llm in engines.values():  # warm-up: the batch's prefill and decode shapes (kernels compile on a GPU)
                run(llm, prompts, 6)
            base = run(engines["off"], prompts, args.max_tokens)
            for method in args.methods:
                spec = run(engines[method], prompts, args.max_tokens)
                same = sum(spec["tokens"][r] == t for r, t in base["tokens"].items())
                if same != len(base["tokens"]) and common["dtype"] == "float32":
                    raise SystemExit(f"{workload} batch {batch} {method}: speculative tokens differ from the baseline")
                alen, arate = spec["mean_accepted_length"], spec["acceptance_rate"]
                print(f"{workload:<11}{method:<12}{batch:>6}{base['tokens_per_s']:>12.1f}{spec['tokens_per_s']:>12.1f}"
                      f"{spec['tokens_per_s'] / base['tokens_per_s']:>8.2f}x{base['tpot_ms']:>14.1f}"
                      f"{spec['tpot_ms']:>14.1f}{alen if alen is None else round(alen, 2)!s:>12}"
                      f"{arate if arate is None else round(arate, 2)!s:>13}{floor / (alen or 1):>15.3f}"
                      f"{f'{same}/{batch}':>13}", flush=True)
                rows.append({"workload": workload, "method": method, "batch": batch, "k": args.k, "floor_ms": floor, "same_tokens": same,
                             **{f"base_{k}": v for k, v in base.items() if k != "tokens"},
                             **{f"spec_{k}": v for k, v in spec.items() if k != "tokens"}})
    for llm in engines.values():
        llm.shutdown()
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
