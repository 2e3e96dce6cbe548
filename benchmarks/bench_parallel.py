"""Parallel layouts on the CPU (gloo): routed rows per rank, collectives and bytes per step, and step time.

    PYTHONPATH=. python3 benchmarks/bench_parallel.py [--batch 8] [--steps 8] [--configs tp1 tp2 tp2-ep pp2 tp2xpp2 dp2-ep]

Per configuration the embedded tiny K3 (fp32) serves ``--batch`` requests of 32-token prompts; after they are
prefilled the rank counters are reset and ``--steps`` decode steps are timed. Columns, per rank (the max over
ranks, and the ranks' spread where it matters):
- ``rows/layer``: routed (token, expert) rows the rank ran through its experts per MoE layer per step, beside
  ``T x k`` of the step (all replicas' tokens with DP; every rank runs all of them on its intermediate slice
  without EP; about ``T x k / ep`` with EP);
- ``colls/step``: collectives the rank issued per step (all-reduces, all-gathers, all-to-alls, PP sends);
- ``KB/step``: bytes those collectives carried from the rank per step;
- ``step ms``: wall time per decode step (the whole engine step: schedule, broadcast, forward, sample);
- ``ctl ms``: median wall time of an empty step through the executor (no chunks: the command's way to every rank, the
  ranks' error flags and the output's way back, nothing else): the control path's own cost per step.
``dp2-ep`` is DP attention: two replicas (TP1 each, a scheduler and cache each, the batch balanced over them) whose
MoE layers form one EP group of 2 ranks; its ``ctl ms`` steps both replicas (an empty step each).
The peer is the same engine at TP1 (one process); on 2 CPU cores the multi-rank step times measure the control
path and gloo, not a GPU's speed. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import StepInput

CONFIGS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp2-ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2xpp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "dp2-ep": {"data_parallel_size": 2, "enable_expert_parallel": True},
}
NOT_COLLECTIVES = ("moe_rows", "moe_picks", "collective_bytes")
CONTROL_STEPS = 50  # empty steps timed for the control path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(layout: dict, batch: int, steps: int) -> dict:
    llm = LLM(EMBEDDED_DIR, dtype="float32", max_num_seqs=batch, max_model_len=32 + steps + 8,
              max_num_batched_tokens=max(512, 32 * batch), master_port=_port(), distributed_timeout=300.0, **layout)
    try:
        core = llm.engine
        gen = torch.Generator().manual_seed(batch)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(batch):
            core.add_request(f"b{i}", torch.randint(1, llm.vocab_size, (32,), generator=gen).tolist(), params)
        schedulers = [c.scheduler for c in getattr(core, "cores", [core])]  # one per data-parallel replica
        while any(any(not s.is_decoding for s in sch.running) or sch.waiting for sch in schedulers):
            core.step()
        core.step()  # one warm-up decode step
        core.executor.rank_stats(reset=True)
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        step_s = (time.perf_counter() - start) / steps
        ranks = core.executor.rank_stats()
        ctl = []
        replicas = len(schedulers)
        for i in range(CONTROL_STEPS):
            start = time.perf_counter()
            if replicas == 1:
                core.executor.execute(StepInput(step_id=10**6 + i))
            else:
                core.executor.execute_replicas((StepInput(step_id=10**6 + i),) * replicas)
            ctl.append(time.perf_counter() - start)
        ctl_s = statistics.median(ctl)
    finally:
        llm.shutdown()
    cfg = json.loads((EMBEDDED_DIR / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    rows, colls, nbytes = [], [], []
    for r in ranks:
        c = r["collectives"]
        picks = c.get("moe_picks", 0)  # tokens of the rank's replica (batch / replicas) x k x its MoE layers
        layers = picks // (batch // replicas * text["num_experts_per_token"]) // steps if picks else 0
        rows.append(c.get("moe_rows", 0) / max(1, steps * layers) if layers else 0.0)
        colls.append(sum(v for k, v in c.items() if k not in NOT_COLLECTIVES) / steps)
        nbytes.append(c.get("collective_bytes", 0) / steps)
    return {"ranks": len(ranks), "rows": rows, "tk": batch * text["num_experts_per_token"], "colls": colls,
            "bytes": nbytes, "step_ms": step_s * 1e3, "ctl_ms": ctl_s * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"bench_parallel: embedded tiny K3, fp32, CPU gloo, batch {args.batch}, {args.steps} decode steps")
    print(f"{'config':>8} | {'ranks':>5} | {'rows/layer (max, min)':>21} | {'T x k':>5} | {'colls/step':>10} | "
          f"{'KB/step':>8} | {'ctl ms':>6} | {'step ms':>8}")
    base = None
    for name in args.configs:
        r = run_config(CONFIGS[name], args.batch, args.steps)
        base = r["step_ms"] if name == "tp1" else base
        rel = f" ({r['step_ms'] / base:.2f}x tp1)" if base and name != "tp1" else ""
        moe_ranks = [x for x in r["rows"] if x]
        print(f"{name:>8} | {r['ranks']:>5} | {max(moe_ranks):>10.1f}, {min(moe_ranks):>8.1f} | {r['tk']:>5} | "
              f"{max(r['colls']):>10.1f} | {max(r['bytes']) / 1024:>8.1f} | {r['ctl_ms']:>6.2f} | "
              f"{r['step_ms']:>8.1f}{rel}")


if __name__ == "__main__":
    main()
