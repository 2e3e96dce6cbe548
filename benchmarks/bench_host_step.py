"""Host (Python) time of one decode step, split by part, on the CPU, with the model's forward replaced.

    PYTHONPATH=. python3 benchmarks/bench_host_step.py [--batch 1 8 32 128] [--steps 64] [--repeats 5]
                                                       [--profile 32]

The real engine classes run a decode step end to end (``EngineCore.step``: ``Scheduler.schedule`` -> the in-process
``Worker.execute`` -> ``Scheduler.update`` / detokenisation / stop checks / ``RequestDelta`` building) on the tiny
checkpoint (byte tokenizer, so text and stop checks run), with the forward replaced by a stand-in: the runner's
decode graphs are a :class:`~rocm_k3.worker.cuda_graph.DecodeGraphs` on the CPU whose ``replay`` returns a
precomputed logits buffer (one of a few, cycled, so tokens vary) instead of running a captured graph. So a
step's host path is the one a GPU decode-graph step takes (apply deltas, plan, ``decode_layout`` + the fill into
the packed mirror, the sampler, the one read, the outputs), and the model costs ~nothing. The sampler runs its real
torch ops on CPU tensors [B, vocab 1024]: on the CPU they are the host-side dispatch of those ops plus small
CPU kernels (an upper bound of the sampler's host launch cost on a GPU).

Columns (per decode step, the minimum over ``--repeats`` runs of ``--steps`` steps after warm-up, microseconds):
schedule = ``Scheduler.schedule`` (with the ``StepInput`` it builds); worker = ``Worker.execute`` minus the sampler
and the stand-in replay: request deltas, the host plan, the graph fill, the sampling batch, ``SampledToken`` /
``StepOutput`` building; sampler = ``sample`` (its torch ops) and the step's token read; outputs = the engine's
commit (``Scheduler.update``: advancing sequences, appending tokens, detokenising, stop checks, deltas);
step = the whole ``EngineCore.step`` (``other`` = step minus the named parts). Greedy requests (temperature 0,
``ignore_eos``) with 64-token prompts; ``--temperature``/``--seeded`` for sampled rows. ``--profile B`` prints a
cProfile of B-request decode steps (cumulative time, top functions).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import numpy as np
import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker import worker as worker_module
from rocm_k3.worker.cuda_graph import DecodeGraphs, graph_buckets

PARTS = ("schedule", "worker", "sampler", "outputs", "step")


class StandInGraphs(DecodeGraphs):
    """Decode graphs on the CPU: the real fill, and a replay that hands back precomputed logits."""

    def __init__(self, runner, buckets: list[int], vocab: int, variants: int = 4) -> None:
        super().__init__(model=None, pools=runner.pools, width=runner.max_blocks_per_seq, buckets=buckets)
        gen = torch.Generator().manual_seed(0)
        self._variants = [torch.randn(buckets[-1], vocab, generator=gen) for _ in range(variants)]  # [B, V] fp32
        self._turn = 0
        self.replay_s = 0.0
        for b in buckets:
            self._graphs[(b, 1)] = None
            self._tapped[(b, 1)] = None

    def replay(self, key):
        t0 = time.perf_counter()
        self._turn = (self._turn + 1) % len(self._variants)
        logits = self._variants[self._turn][: key[0] * key[1]]
        self.replay_s += time.perf_counter() - t0
        return logits, None


class Timers:
    """Wraps the parts' functions with perf_counter accumulators (per instance or module attribute)."""

    def __init__(self) -> None:
        self.s = dict.fromkeys(PARTS, 0.0)

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)
        acc = self.s

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[part] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def reset(self) -> None:
        for k in self.s:
            self.s[k] = 0.0


def build(tiny: str, max_num_seqs: int) -> tuple[LLM, StandInGraphs]:
    llm = LLM(tiny, dtype="float32", device="cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
              max_model_len=2048, enable_prefix_caching=True)
    worker = llm.engine.executor.worker
    graphs = StandInGraphs(worker.runner, graph_buckets(max_num_seqs), llm.vocab_size)
    worker.runner.graphs = graphs
    return llm, graphs


def measure(llm: LLM, graphs: StandInGraphs, batch: int, steps: int, repeats: int, params: SamplingParams,
            profile: bool = False) -> dict[str, float]:
    """Microseconds per decode step (the fastest run) of each part over ``repeats`` runs of ``steps`` steps."""
    engine = llm.engine
    worker = engine.executor.worker
    timers = Timers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine, "_commit", "outputs")
    timers.wrap(engine.executor, "execute", "worker")
    orig_sample = worker_module.sample
    timers.wrap(worker_module, "sample", "sampler")
    runs: dict[str, list[float]] = {k: [] for k in (*PARTS, "other")}
    rng = np.random.default_rng(batch)
    try:
        for r in range(repeats + 1):  # the first run warms up
            ids = [f"b{batch}-r{r}-{i}" for i in range(batch)]
            for rid in ids:  # random prompts: no shared prefix between requests or runs
                engine.add_request(rid, rng.integers(0, llm.vocab_size, 64).tolist(), params)
            while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()  # the prefills (and the first token)
            if len(engine.scheduler.running) != batch:
                raise RuntimeError(f"expected {batch} decoding requests, got {len(engine.scheduler.running)}")
            timers.reset()
            graphs.replay_s = 0.0
            prof = cProfile.Profile() if profile and r == repeats else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            for _ in range(steps):
                deltas = engine.step()
                if len(deltas) != batch:
                    raise RuntimeError(f"a decode step returned {len(deltas)} deltas for {batch} requests")
            if prof is not None:
                prof.disable()
            total = time.perf_counter() - t0
            for rid in ids:
                engine.abort(rid)
            engine.step()  # tells the worker the aborted ids
            if r == 0:
                continue
            s = dict(timers.s)
            s["worker"] -= s["sampler"] + graphs.replay_s  # the stand-in forward is no host work of the step
            s["step"] = total - graphs.replay_s
            s["other"] = s["step"] - s["schedule"] - s["worker"] - s["sampler"] - s["outputs"]
            for k, v in s.items():
                runs[k].append(v / steps * 1e6)
            if prof is not None:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    finally:
        worker_module.sample = orig_sample
        for owner, name in ((engine.scheduler, "schedule"), (engine, "_commit"), (engine.executor, "execute")):
            owner.__dict__.pop(name, None)
    return {k: min(v) for k, v in runs.items()}  # the least disturbed run (a shared machine): host work only adds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seeded", action="store_true", help="each request gets a seed")
    ap.add_argument("--profile", type=int, default=0, help="print a cProfile of decode steps at this batch size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(write_tiny_checkpoint(tmp, seed=2))
        llm, graphs = build(tiny, max(max(args.batch), args.profile))
        params = SamplingParams(temperature=args.temperature, max_tokens=1024, ignore_eos=True,
                                seed=1234 if args.seeded else None)
        if args.profile:
            measure(llm, graphs, args.profile, args.steps, 1, params, profile=True)
            return
        print(f"host time per decode step, us (CPU, forward stand-in; {args.steps} steps x {args.repeats} runs, "
              f"fastest run per part; temperature {args.temperature})")
        print("| B | schedule | worker (plan + fill + outputs objects) | sampler (+ read) | outputs (update) | "
              "other | step | schedule + worker + outputs |")
        print("|---|---|---|---|---|---|---|---|")
        for b in args.batch:
            m = measure(llm, graphs, b, args.steps, args.repeats, params)
            print(f"| {b} | {m['schedule']:.0f} | {m['worker']:.0f} | {m['sampler']:.0f} | {m['outputs']:.0f} | "
                  f"{m['other']:.0f} | {m['step']:.0f} | {m['schedule'] + m['worker'] + m['outputs']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
