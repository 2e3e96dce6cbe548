"""The engine with two steps in flight (pipeline parallelism's micro-batches), in one process.

An executor of ``pipeline_depth`` 2 over the in-process worker queues submitted steps and runs the oldest when its
output is collected: the order every pipeline rank runs them in, while the scheduler already planned the next one.
Checked: the greedy tokens of one step at a time (prefix caching, chunked prefill, preemption), two steps in flight
in steady state, no request in two steps in flight, an abort while a request's step is in flight, and every block
and slot free at the end. The real processes: tests/parallel/test_pipeline_overlap.py.
"""

from __future__ import annotations

import collections

import pytest
import torch

from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.engine.scheduler import Scheduler
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.config import SpeculativeConfig
from tests.engine_fixtures import core_for
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = list(range(40, 72))
PROMPTS = [[5, 6, 7], SHARED + [1, 2], SHARED + [3], list(range(100, 160)), [9] * 17, [11, 12], SHARED[:20],
           [77] * 30]  # prefix hits, a prompt longer than the step budget (chunked), more requests than max_num_seqs


class QueuedExecutor:
    """Depth 2 over an in-process executor: ``submit`` queues, ``collect`` runs the oldest step."""

    pipeline_depth = 2

    def __init__(self, inner) -> None:
        self.inner = inner
        self.queue: collections.deque = collections.deque()
        self.overlaps = 0  # submits that found requests of a queued step in the new one (must stay 0)

    def submit(self, step) -> None:
        queued = {c.request_id for s in self.queue for c in s.chunks}
        self.overlaps += bool(queued & {c.request_id for c in step.chunks})
        self.queue.append(step)

    def collect(self):
        return self.inner.execute(self.queue.popleft())

    def rank_stats(self, reset: bool = False) -> list[dict]:
        return self.inner.rank_stats(reset)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_k3_pipelined")
    write_tiny_checkpoint(root, seed=11)
    return load_model(root, dtype=torch.float32, progress=False)


def _cores(model, num_blocks: int = 40, speculative: SpeculativeConfig | None = None) -> tuple[EngineCore,
                                                                                               EngineCore]:
    """(one step at a time, two steps in flight) over the same cache geometry."""
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, enable_prefix_caching=True,
                        num_blocks=num_blocks, num_state_slots=24)
    cfg = EngineConfig(max_num_batched_tokens=48, max_num_seqs=4, max_model_len=80, cache=cache,
                       speculative=speculative)
    one = core_for(model, cfg)
    two = EngineCore(cfg, QueuedExecutor(core_for(model, cfg).executor), geometry=one.geometry,
                     vocab_size=one.vocab_size, eos_token_ids=one.eos_token_ids)
    return one, two


def _run(core: EngineCore, abort: str | None = None) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), prompt, GREEDY)
    done, aborted = {}, abort is None
    for _ in range(400):
        if not core.has_unfinished():
            break
        if not aborted and any(item.seq.request_id == abort and not item.is_prefill
                               for out in core.scheduler.steps_in_flight for item in out.scheduled):
            assert core.abort(abort)
            aborted = True
        for d in core.step():
            if d.finished:
                done[d.request_id] = d.output.token_ids
    assert aborted and not core.has_unfinished()
    # has_unfinished counts steps in flight, so a step holding only the aborted request was collected too
    assert not core.scheduler.steps_in_flight
    return done


def _all_free(core: EngineCore) -> None:
    stats = core.stats()
    assert stats["free_blocks"] == stats["num_blocks"], stats
    assert stats["free_state_slots"] == stats["num_state_slots"], stats
    assert core.cache_manager.pending_saves() == set()


def test_two_steps_in_flight_give_the_tokens_of_one(model) -> None:
    one, two = _cores(model)
    expected = _run(one)
    assert _run(two) == expected
    stats = two.stats()
    assert stats["steps_in_flight_max"] == 2 and stats["steps_in_flight_mean"] > 1.5, stats
    assert stats["hit_tokens"] > 0, stats
    assert two.executor.overlaps == 0
    _all_free(two)
    assert one.stats()["steps_in_flight_max"] == 0  # one step at a time: the old path, no collects


def test_preemption_and_an_abort_in_flight_free_everything(model) -> None:
    one, two = _cores(model, num_blocks=7)
    expected = _run(one)
    got = _run(two, abort="3")
    assert "3" not in got
    assert got == {k: v for k, v in expected.items() if k != "3"}
    assert two.stats()["preemptions"] > 0 and two.executor.overlaps == 0
    _all_free(two)


def test_one_stage_keeps_one_step_in_flight(model) -> None:
    one, _ = _cores(model)
    sched: Scheduler = one.scheduler
    one.add_request("a", [1, 2, 3], GREEDY)
    sched.schedule()
    with pytest.raises(RuntimeError, match="still in flight"):
        sched.schedule()
    with pytest.raises(ValueError, match="max_in_flight"):
        Scheduler(one.config, one.cache_manager, max_in_flight=0)


def test_disable_by_batch_size_counts_every_decoding_sequence_not_a_micro_batchs(model) -> None:
    """Two decoding requests split over two micro-batches (one each): the cut at 2 counts both, so no step
    drafts; one request alone drafts. The tokens are the greedy ones either way."""
    prompts = {"a": [5, 6, 7] * 6, "b": [9, 10] * 8}  # repetitive: the n-gram proposer finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cut = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)

    def run(core: EngineCore, rids) -> dict[str, list[int]]:
        for rid in rids:
            core.add_request(rid, prompts[rid], params)
        done = {}
        for _ in range(200):
            if not core.has_unfinished():
                break
            done.update({d.request_id: d.output.token_ids for d in core.step() if d.finished})
        return done

    expected = run(_cores(model)[0], prompts)
    _, both = _cores(model, speculative=cut)
    assert run(both, prompts) == expected
    stats = both.stats()
    assert stats["steps_in_flight_max"] == 2, stats  # the two requests decoded in separate micro-batches
    assert stats["spec_num_draft_tokens"] == 0, stats
    _all_free(both)
    _, alone = _cores(model, speculative=cut)
    assert run(alone, ["a"]) == {"a": expected["a"]}
    assert alone.stats()["spec_num_draft_tokens"] > 0
    _all_free(alone)
