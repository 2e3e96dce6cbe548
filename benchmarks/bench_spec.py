"""Speculative decoding on the CPU: tokens/s and TPOT with and without speculation (n-gram prompt lookup and the
embedded hidden-state drafter) at batch 1, 8, 32.

Run: ``PYTHONPATH=. python benchmarks/bench_spec.py [--batches 1 8 32] [--k 3] [--max-tokens 64]
[--methods ngram draft_model] [--json OUT]``. Embedded tiny K3 (fp32, reference ops, one intra-op thread); the
drafter is ``embedded-drafter``. Workloads: ``repetitive`` (prompts that repeat a phrase, where prompt lookup
finds drafts) and ``plain`` (short natural prompts). The baseline is this engine
decoding one token per step (the peer stacks' numbers are GPU-only and out of reach here); every speculative
run is checked to produce the baseline's greedy tokens. TPOT = (finish - first token) / (tokens - 1) per request,
averaged; tokens/s = generated tokens / wall time of the whole batch (prefill included).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER

REPETITIVE = ["hello hello hello hello hello hello", "def f(x):\n    return x\ndef f(x):\n    return x\n",
              "1 2 3 4 5 6 7 8 9 10 11 12", "The the the the the the the the"]
PLAIN = ["The file", "Return the number of", "If the value is", "A list of"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=["ngram", "draft_model"], choices=["ngram", "draft_model"])
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    common = {"dtype": "float32", "device": "cpu", "max_num_seqs": 32, "max_model_len": 512}
    engines = {"off": LLM(**common)}
    for method in args.methods:
        spec = {"method": method, "num_speculative_tokens": args.k}
        if method == "draft_model":
            spec["model"] = EMBEDDED_DRAFTER
        engines[method] = LLM(**common, speculative_config=spec)
    rows = []
    print(f"{'workload':<11}{'method':<12}{'batch':>6}{'base tok/s':>12}{'spec tok/s':>12}{'speedup':>9}"
          f"{'base TPOT ms':>14}{'spec TPOT ms':>14}{'accept len':>12}{'accept rate':>13}")
    for workload, base_prompts in (("repetitive", REPETITIVE), ("plain", PLAIN)):
        for batch in args.batches:
            prompts = [base_prompts[i % len(base_prompts)] + f" {i}" * (i // len(base_prompts))
                       for i in range(batch)]
            run(engines["off"], prompts[:1], 4)  # warm-up
            base = run(engines["off"], prompts, args.max_tokens)
            for method in args.methods:
                spec = run(engines[method], prompts, args.max_tokens)
                if spec["tokens"] != base["tokens"]:
                    raise SystemExit(f"{workload} batch {batch} {method}: speculative tokens differ from the baseline")
                alen, arate = spec["mean_accepted_length"], spec["acceptance_rate"]
                print(f"{workload:<11}{method:<12}{batch:>6}{base['tokens_per_s']:>12.1f}{spec['tokens_per_s']:>12.1f}"
                      f"{spec['tokens_per_s'] / base['tokens_per_s']:>8.2f}x{base['tpot_ms']:>14.1f}"
                      f"{spec['tpot_ms']:>14.1f}{alen if alen is None else round(alen, 2)!s:>12}"
                      f"{arate if arate is None else round(arate, 2)!s:>13}")
                rows.append({"workload": workload, "method": method, "batch": batch, "k": args.k,
                             **{f"base_{k}": v for k, v in base.items() if k != "tokens"},
                             **{f"spec_{k}": v for k, v in spec.items() if k != "tokens"}})
    for llm in engines.values():
        llm.shutdown()
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
