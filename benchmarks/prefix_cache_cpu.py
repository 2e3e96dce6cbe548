"""Prefix caching on a shared-prefix workload, on the CPU with the embedded tiny K3 model (reference ops).

Run: ``PYTHONPATH=. python benchmarks/prefix_cache_cpu.py [--prefix-len 512] [--num-requests 8] [--json OUT]``.
N requests share a ``prefix-len``-token system prompt and each adds ``suffix-len`` tokens of its own; one arrives
every ``arrival-interval`` engine steps (0: all at once, as from one ``LLM.generate`` call: the scheduler then
prefills the shared prefix once and holds the others back until its states are saved) and each generates
``max-tokens`` greedy tokens. The same workload runs on the engine with prefix caching off
and on (same model, same granularities); the script reports prefill tokens computed and saved, wall time, the
prefix-cache counters, and checks that both runs produced identical tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the embedded tiny K3)")
    p.add_argument("--prefix-len", type=int, default=448)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=6)
    p.add_argument("--arrival-interval", type=int, default=0, help="engine steps between arrivals")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--match-unit", type=int, default=64)
    p.add_argument("--alignment", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny matmuls: 1 is fastest)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def run_once(args: argparse.Namespace, prompts: list[list[int]], caching: bool) -> dict:
    """One pass of the workload on a fresh engine (the same checkpoint and granularities) with prefix caching
    ``caching``; requests enter ``arrival_interval`` engine steps apart."""
    max_len = max(len(p) for p in prompts) + args.max_tokens
    llm = LLM(args.model, dtype="float32", device="cpu", enable_prefix_caching=caching, block_size=args.block_size,
              match_unit=args.match_unit, alignment=args.alignment, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, max_model_len=max_len)
    engine = llm.engine  # EngineCore: requests in, one scheduled step at a time
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    queue = list(enumerate(prompts))
    outputs = {}
    step = 0
    while queue or engine.has_unfinished():
        while queue and queue[0][0] * args.arrival_interval <= step:
            i, prompt = queue.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        if engine.has_unfinished():
            for d in engine.step():
                if d.finished and d.output is None:
                    raise RuntimeError(f"request {d.request_id} failed: {d.error}")
                if d.finished:
                    outputs[d.request_id] = d.output
        step += 1
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return {
        "caching": caching,
        "seconds": elapsed,
        "tokens": {k: v.token_ids for k, v in sorted(outputs.items())},
        "stats": engine.stats(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = 256  # ids every K3 checkpoint holds (the embedded tiny model's byte range)
    prefix = torch.randint(1, vocab, (args.prefix_len,), generator=gen).tolist()
    prompts = [
        prefix + torch.randint(1, vocab, (args.suffix_len,), generator=gen).tolist() for _ in range(args.num_requests)
    ]
    off = run_once(args, prompts, caching=False)
    on = run_once(args, prompts, caching=True)
    identical = off["tokens"] == on["tokens"]
    s_off, s_on = off["stats"], on["stats"]
    saved = s_off["prefill_tokens"] - s_on["prefill_tokens"]
    print(
        f"workload: {args.num_requests} requests x ({args.prefix_len} shared + {args.suffix_len} own) tokens, "
        f"one every {args.arrival_interval} step(s), {args.max_tokens} generated; block {args.block_size}, match unit {args.match_unit}, "
        f"alignment {args.alignment}"
    )
    print(f"{'prefix caching':<16}{'prefill tokens':>16}{'steps':>8}{'seconds':>10}")
    for run in (off, on):
        st = run["stats"]
        print(
            f"{'on' if run['caching'] else 'off':<16}{st['prefill_tokens']:>16}{st['steps']:>8}{run['seconds']:>10.2f}"
        )
    print(
        f"prefill tokens saved: {saved} ({saved / max(1, s_off['prefill_tokens']):.1%}); "
        f"time saved: {off['seconds'] - on['seconds']:.2f} s ({off['seconds'] / on['seconds']:.2f}x)"
    )
    print(
        f"hit tokens {s_on['hit_tokens']}, hit requests {s_on['hit_requests']}/{s_on['queries']}, "
        f"saved states {s_on['saved_states']}, COW copies {s_on['cow_copies']}; identical outputs: {identical}"
    )
    if args.json is not None:
        result = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "off": off,
            "on": on,
            "prefill_tokens_saved": saved,
            "seconds_saved": off["seconds"] - on["seconds"],
            "identical_outputs": identical,
        }
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
