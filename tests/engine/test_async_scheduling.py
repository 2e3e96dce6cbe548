"""Asynchronous scheduling (``--async-scheduling``): step N + 1 is scheduled and launched before step N's output is
read; a plain decode in flight is scheduled again with a placeholder input token that the worker takes on the device
from step N's samples.

Checked against one step at a time on the same cache geometry: greedy and seeded tokens, finish reasons and texts
identical with prefix caching on and off, chunked prefill, forced preemption, stop tokens and stop strings, EOS,
max_tokens (never overshot), penalties and structured output (scheduled one step later), an abort while the request
is in a step scheduled ahead; every block and slot free afterwards; steps really overlap (two in flight, placeholder
decodes sent) and the identity fails when the worker does not take the previous step's tokens. AsyncLLM streams the
same tokens with the flag on. The refusals (speculation, KV transfer, several processes) name the flag.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

import rocm_k3
from rocm_k3.args import EngineArgs
from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.async_llm import AsyncLLM
from rocm_k3.engine.assembly import assemble_engine
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.structured import StructuredOutputs
from rocm_k3.worker.model_runner import ModelRunner
from tests.engine_fixtures import assert_pools_released, core_for
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

SHARED = list(range(40, 72))
PROMPTS = [[5, 6, 7], SHARED + [1, 2], SHARED + [3], list(range(100, 160)), [9] * 17, [11, 12], SHARED[:20],
           [77] * 30]  # prefix hits, a prompt longer than the step budget (chunked), more requests than max_num_seqs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_k3_async")
    write_tiny_checkpoint(root, seed=11)
    return load_model(root, dtype=torch.float32, progress=False)


def _cores(model, *, num_blocks: int = 40, caching: bool = True) -> tuple[EngineCore, EngineCore]:
    """(one step at a time, asynchronous scheduling) over the same cache geometry."""
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, enable_prefix_caching=caching,
                        num_blocks=num_blocks, num_state_slots=24)
    cfg = EngineConfig(max_num_batched_tokens=48, max_num_seqs=4, max_model_len=80, cache=cache)
    return core_for(model, cfg), core_for(model, dataclasses.replace(cfg, async_scheduling=True))


def _params(reference: dict[str, list[int]] | None = None) -> list[SamplingParams]:
    """One request kind per prompt: greedy, seeded at temperature 1, short max_tokens (1, 2), a penalty, and a
    stop token taken from the reference greedy output (it finishes mid-stream)."""
    stop = [] if reference is None else [reference["6"][3]]
    return [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=4, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, frequency_penalty=0.5),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=stop),
            SamplingParams(temperature=0.0, max_tokens=6)]  # EOS as the model's config gives it


def _run(core: EngineCore, params: list[SamplingParams], abort: str | None = None, counts=None) -> dict:
    """Every prompt to the end: {request id: (tokens, finish reason)}; ``abort``: that request is aborted while a
    step scheduled ahead of its output (a placeholder decode) is in flight, and must stream nothing after."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        core.add_request(str(i), prompt, p)
    done, aborted, after_abort = {}, abort is None, []
    for _ in range(400):
        if not core.has_unfinished():
            break
        if not aborted and any(item.seq.request_id == abort and item.placeholder
                               for out in core.scheduler.steps_in_flight for item in out.scheduled):
            assert core.abort(abort)
            aborted = True
        if counts is not None:
            counts.append(len(core.scheduler.steps_in_flight))
        for d in core.step():
            if aborted and d.request_id == abort:
                after_abort.append(d)
            if d.finished:
                done[d.request_id] = (d.output.token_ids, d.output.finish_reason)
    assert aborted and not core.has_unfinished() and not after_abort
    assert not core.scheduler.steps_in_flight
    return done


def _all_free(core: EngineCore) -> None:
    """Every block and slot back (the engine fixtures' leak check), no save pending, no free still deferred."""
    assert_pools_released(core.stats())
    assert not core.cache_manager.pending_saves() and not core.scheduler._free_after and not core.cache_manager.seqs


def _placeholder_steps(core: EngineCore) -> list[int]:
    """Counts, per submitted step, its placeholder decodes (wraps the executor's submit)."""
    sent: list[int] = []
    submit = core.executor.submit

    def counting(step):
        sent.append(sum(c.from_previous for c in step.chunks))
        return submit(step)

    core.executor.submit = counting
    return sent


@pytest.mark.parametrize("caching", [True, False])
def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(model, caching) -> None:
    ref = _run(_cores(model, caching=caching)[0], _params())
    sync, fast = _cores(model, caching=caching)
    params = _params({k: v[0] for k, v in ref.items()})
    expected = _run(sync, params)
    assert expected["6"][1] == "stop" and len(expected["6"][0]) <= 4  # stopped mid-stream on its stop token
    sent = _placeholder_steps(fast)
    got = _run(fast, params)
    assert got == expected
    for rid, (tokens, _) in got.items():
        assert len(tokens) <= params[int(rid)].max_tokens
    stats = fast.stats()
    assert stats["steps_in_flight_max"] == 2 and sum(sent) > 0, (stats, sent)
    assert stats["hit_tokens"] > 0 if caching else stats["hit_tokens"] == 0
    _all_free(fast)


def test_preemption_and_an_abort_ahead_free_everything(model) -> None:
    sync, fast = _cores(model, num_blocks=7)
    params = _params()
    expected = _run(sync, params)
    got = _run(fast, params, abort="0")
    assert "0" not in got
    assert got == {k: v for k, v in expected.items() if k != "0"}
    assert fast.stats()["preemptions"] > 0
    _all_free(fast)


def test_steps_overlap_and_the_placeholder_path_is_what_keeps_tokens_right(model, monkeypatch) -> None:
    sync, fast = _cores(model)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * len(PROMPTS)
    expected = _run(sync, params)
    counts: list[int] = []
    sent = _placeholder_steps(fast)
    assert _run(fast, params, counts=counts) == expected
    steady = counts[len(counts) // 3 : 2 * len(counts) // 3]
    assert steady and min(steady) >= 1 and counts.count(1) > len(counts) // 2, counts  # one ahead at each step
    assert max(sent) == 4, sent  # every running decode (max_num_seqs) placed ahead
    # the worker no longer takes step N's tokens into step N + 1: the outputs change
    monkeypatch.setattr(ModelRunner, "_take_previous",
                        lambda self, ids, rows: None if self._take is None else
                        ids.index_fill_(0, torch.from_numpy(rows[self._take[0]].astype("int64")), 0))
    _, broken = _cores(model)
    assert _run(broken, params) != expected


def test_max_tokens_is_never_overshot_and_a_last_token_is_not_scheduled_ahead(model) -> None:
    _, fast = _cores(model)
    sent = _placeholder_steps(fast)
    fast.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    tokens = []
    while fast.has_unfinished():
        tokens += [t for d in fast.step() for t in d.new_token_ids]
    # prefill (token 1), decode (token 2), then token 3 ahead of token 2 would be its last: no step after it
    assert len(tokens) == 3 and sent == [0, 0, 1], sent
    _all_free(fast)


@pytest.fixture(scope="module")
def llms():
    kw = dict(dtype="float32", max_model_len=512)
    return rocm_k3.LLM(**kw), rocm_k3.LLM(**kw, async_scheduling=True)


def test_stop_strings_eos_and_structured_output_through_llm(llms) -> None:
    sync, fast = llms
    prompts = ["one prompt", "a second, longer prompt here", "pick one", "the fourth"]
    free = sync.generate(prompts[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].text
    params = [SamplingParams(temperature=0, max_tokens=10, stop=[free[3:5]]),  # a stop string mid-stream
              SamplingParams(temperature=0.7, seed=9, max_tokens=24),  # EOS may come
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(choice=["yes", "no"]),
                             skip_special_tokens=False),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    want = [(o.token_ids, o.text, o.finish_reason) for o in sync.generate(prompts, params)]
    got = [(o.token_ids, o.text, o.finish_reason) for o in fast.generate(prompts, params)]
    assert got == want
    assert want[0][2] == "stop" and want[2][2] == "stop"
    stats = fast.engine.stats()
    assert stats["steps_in_flight_max"] == 2, stats
    # the last request to finish stops on a string while its next token is in flight: that step is collected
    # before generate returns, so nothing stays held
    last = fast.generate(prompts[0], params[0])[0]
    assert (last.token_ids, last.text, last.finish_reason) == want[0]
    assert not fast.engine.scheduler.steps_in_flight
    assert_pools_released(fast.engine.stats())


def test_async_llm_streams_the_same_tokens(llms) -> None:
    sync, _ = llms
    tok = sync.tokenizer
    requests = [(f"r{i}", tok.encode(f"prompt {i} " * (1 + i)),
                 SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=4 + i, ignore_eos=True))
                for i in range(4)]
    alone = [sync.generate(p, s)[0].token_ids for _, p, s in requests]
    engine = AsyncLLM(assemble_engine(EngineArgs(dtype="float32", max_model_len=512, async_scheduling=True)).core)

    async def collect(rid, prompt, params):
        ids = []
        async for delta in engine.generate(prompt, params, rid):
            ids += delta.new_token_ids
        return ids

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(*r) for r in requests)), 60)

    try:
        assert asyncio.run(main()) == alone
        assert engine.stats()["steps_in_flight_max"] == 2
    finally:
        engine.shutdown()


def test_refusals_name_the_flag(model) -> None:
    with pytest.raises(ValueError, match="async_scheduling.*speculative"):
        EngineConfig(async_scheduling=True, speculative=SpeculativeConfig())
    with pytest.raises(TypeError, match="async_scheduling"):
        EngineConfig(async_scheduling=1)
    with pytest.raises(ValueError, match="async_scheduling.*in-process"):
        EngineArgs(async_scheduling=True, tensor_parallel_size=2).validated()
    with pytest.raises(ValueError, match="async_scheduling.*speculative"):
        EngineArgs(async_scheduling=True, speculative_config='{"method": "ngram"}').validated()
    sync, _ = _cores(model)

    class Staged:  # a pipelined executor (several stages): not the in-process one
        pipeline_depth = 2

    with pytest.raises(ValueError, match="async_scheduling.*in-process"):
        EngineCore(dataclasses.replace(sync.config, async_scheduling=True), Staged(), geometry=sync.geometry,
                   vocab_size=sync.vocab_size)


class Injected(Exception):
    """Stands for a failed step on the device or an exception escaping the bookkeeping."""


@pytest.mark.parametrize("where", ["launch", "finish", "update"])
def test_a_failure_with_two_steps_in_flight_recomputes_and_leaks_nothing(model, monkeypatch, where) -> None:
    sync, fast = _cores(model)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * len(PROMPTS)
    expected = _run(sync, params)
    owner = {"launch": fast.executor.worker, "finish": fast.executor.worker, "update": fast.scheduler}[where]
    name = {"launch": "_launch", "finish": "_finish", "update": "update"}[where]
    original, calls, failed = getattr(owner, name), [0], []

    def failing(*args):
        calls[0] += 1
        if calls[0] in (6, 11) and len(fast.scheduler.steps_in_flight) == 2:
            failed.append(calls[0])
            raise Injected(f"{where} #{calls[0]}")
        return original(*args)

    monkeypatch.setattr(owner, name, failing)
    for i, prompt in enumerate(PROMPTS):
        fast.add_request(str(i), prompt, params[i])
    done, tokens = {}, {str(i): [] for i in range(len(PROMPTS))}
    for _ in range(400):
        if not fast.has_unfinished():
            break
        try:
            deltas = fast.step()
        except Injected:
            continue
        for d in deltas:
            tokens[d.request_id] += d.new_token_ids
            if d.finished:
                done[d.request_id] = (d.output.token_ids, d.output.finish_reason)
    assert failed, calls
    assert done == expected
    assert tokens == {k: v[0] for k, v in expected.items()}  # streamed once each, nothing lost or repeated
    _all_free(fast)
