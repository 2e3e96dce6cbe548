"""dist tier: pipeline parallelism that overlaps (issue #32), as real processes over gloo on the CPU.

With ``pipeline_parallel_size`` = 2 the engine keeps two micro-batches in flight (the first stage runs step N + 1
while the last one still runs step N; hidden states go on with asynchronous point-to-point sends). Checked: PP2
and TP2 x PP2 give one process's greedy tokens on the trained embedded model and on a Kimi Linear checkpoint
written by transformers, with more requests than one micro-batch holds; the engine counts two steps in flight in
steady state and the ranks' step times show stage 0 starting step N + 1 before the last stage ended step N; a
layer split where stage 0 owns no KDA layer and stage 1 no MLA layer; abort and preemption under PP2 leave every
block and slot free; a rank that raises or dies while steps are in flight ends the run with an error naming it.
The trained embedded model's check runs by default; the others are marked slow (the one-process twin of their
scheduling checks: tests/engine/test_pipelined_steps.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rocm_k3.engine.llm import LLM
from rocm_k3.executor.multiproc import WorkerDiedError, WorkerError
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import ScheduledChunk, StepInput
from tests.model_fixtures import write_kimi_linear_checkpoint
from tests.parallel.test_dist import ENGINE, TP4_KIMI_LINEAR, free_port

pytestmark = pytest.mark.dist
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# six requests, four running at once: a micro-batch holds two of them (max_num_seqs / stages)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 58)), [100] * 20 + [3, 1, 4], [7] * 9, list(range(200, 217)), [42, 43]]
TRAINED_PROMPTS = ["The file", "Return the number of", "If the value is", "def main", "The list", "# compute"]
# MLA layers 1-2, KDA layers 3-4: at PP=2 stage 0 owns no KDA layer and stage 1 no MLA layer
GROWING = [[10 + i] * 15 + [i] for i in range(6)]  # one block each when admitted, two once they decode
MLA_FIRST = {"num_hidden_layers": 4, "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                                                              "full_attn_layers": [1, 2], "kda_layers": [3, 4]}}


def _run(path: Path, prompts, **layout) -> tuple[list[list[int]], dict, list[dict]]:
    llm = LLM(path, master_port=free_port(), **{**ENGINE, **layout})
    try:
        outs = llm.generate(prompts, GREEDY)
        stats = llm.stats()
        ranks = llm.engine.executor.rank_stats() if layout.get("pipeline_parallel_size", 1) > 1 else []
        assert stats["free_blocks"] == stats["num_blocks"] and stats["free_state_slots"] == stats["num_state_slots"]
        return [o.token_ids for o in outs], stats, ranks
    finally:
        llm.shutdown()


def _overlapped_steps(ranks: list[dict]) -> tuple[int, int]:
    """(steps N whose step N + 1 started on stage 0 before the last stage ended step N, steps compared)."""
    first = dict((s, (t0, t1)) for s, t0, t1 in next(r for r in ranks if r["rank"] == 0)["step_spans"])
    last_stage = max(r["pp_rank"] for r in ranks)
    last = dict((s, (t0, t1)) for s, t0, t1 in
                next(r for r in ranks if r["pp_rank"] == last_stage and r["tp_rank"] == 0)["step_spans"])
    steps = sorted(last)
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if b in first]
    return sum(first[b][0] < last[a][1] for a, b in pairs), len(pairs)


def _check_overlap(stats: dict, ranks: list[dict]) -> None:
    assert stats["steps_in_flight_max"] == 2, stats
    assert stats["steps_in_flight_mean"] > 1.5, stats  # two in flight but for the ramp and the drain
    overlapped, pairs = _overlapped_steps(ranks)
    assert pairs >= 10 and overlapped >= pairs // 2, (overlapped, pairs)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pp_kimi_linear")
    write_kimi_linear_checkpoint(path, seed=4, **TP4_KIMI_LINEAR)
    return path


def test_trained_embedded_model_pp2_overlaps_and_matches_one_process() -> None:
    single, _, _ = _run(EMBEDDED_DIR, TRAINED_PROMPTS)
    tokens, stats, ranks = _run(EMBEDDED_DIR, TRAINED_PROMPTS, pipeline_parallel_size=2)
    assert tokens == single
    _check_overlap(stats, ranks)


@pytest.mark.slow
def test_kimi_linear_pp2_and_tp2_pp2_match_one_process(kimi_linear) -> None:
    single, _, _ = _run(kimi_linear, PROMPTS)
    tokens, stats, ranks = _run(kimi_linear, PROMPTS, pipeline_parallel_size=2)
    assert tokens == single
    _check_overlap(stats, ranks)
    tokens, stats, _ = _run(kimi_linear, PROMPTS, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert tokens == single
    assert stats["steps_in_flight_max"] == 2, stats


@pytest.mark.slow
def test_mla_first_split_with_abort_and_preemption_frees_everything(tmp_path) -> None:
    """Stage 0 owns only MLA layers, stage 1 only KDA layers. A cache of few blocks preempts; a request aborted
    while its step is in flight is dropped when that step's output comes; every block and slot is free after."""
    write_kimi_linear_checkpoint(tmp_path, seed=5, **MLA_FIRST)
    small = {"kv_cache_bytes": 6 * 16 * 4608, "max_model_len": 64}  # 6 blocks of 16 tokens (4608 MLA bytes a token)
    single, _, _ = _run(tmp_path, GROWING, **small)
    llm = LLM(tmp_path, master_port=free_port(), **{**ENGINE, **small}, pipeline_parallel_size=2)
    try:
        core = llm.engine
        for i, prompt in enumerate(GROWING):
            core.add_request(str(i), prompt, GREEDY)
        core.add_request("doomed", list(range(30, 45)), GREEDY)
        done, aborted = {}, False
        for _ in range(500):
            if not core.has_unfinished():
                break
            if not aborted and any(item.seq.request_id == "doomed" for out in core.scheduler.steps_in_flight
                                   for item in out.scheduled if not item.is_prefill):
                assert core.abort("doomed")  # its decode step is in flight
                aborted = True
            for d in core.step():
                if d.finished:
                    done[d.request_id] = d.output.token_ids
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert aborted and "doomed" not in done
    assert [done[str(i)] for i in range(len(GROWING))] == single
    assert stats["preemptions"] > 0, stats
    assert stats["steps_in_flight_max"] == 2, stats
    assert stats["free_blocks"] == stats["num_blocks"] and stats["free_state_slots"] == stats["num_state_slots"]


@pytest.mark.slow
def test_a_failing_or_killed_stage_ends_the_pipelined_run_with_a_named_error(kimi_linear) -> None:
    """Under PP2 no all-reduce follows a step: the last stage reports its error through its own pipe, and a
    killed rank is named by its process's end, both while steps are in flight."""
    llm = LLM(kimi_linear, master_port=free_port(), **ENGINE, pipeline_parallel_size=2)
    ex = llm.engine.executor
    try:
        ghost = ScheduledChunk(request_id="ghost", token_ids=(1, 2), start=0, admitted=True, block_ids=(0,),
                               kda_slot=0, is_prefill=True, sample=True)  # a request the last stage never heard of
        ex.submit(StepInput(step_id=10**6, chunks=(ghost,)))
        with pytest.raises(WorkerError, match="rank 1"):
            ex.collect()
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for _, p in ex._procs)

    llm = LLM(kimi_linear, master_port=free_port(), **ENGINE, pipeline_parallel_size=2)
    ex = llm.engine.executor
    start = time.monotonic()
    try:
        with pytest.raises(WorkerDiedError, match="rank 0"):
            for i in range(200):  # bounded
                if i == 3:
                    os.kill(next(p for rank, p in ex._procs if rank == 0).pid, signal.SIGKILL)
                for j, prompt in enumerate(PROMPTS):
                    llm.engine.add_request(f"{i}-{j}", prompt, GREEDY)
                llm.engine.step()
    finally:
        llm.shutdown()
    assert time.monotonic() - start < 120
    assert all(not p.is_alive() for _, p in ex._procs)
