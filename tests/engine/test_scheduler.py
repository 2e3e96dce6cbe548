"""Scheduler + cache bookkeeping under randomized request mixes (tensor-free simulator, see tests/cache_sim.py).

Every simulated step checks that each sequence reads exactly its own prefix through its block table and KDA slot
(so wrong sharing or a missed copy-on-write fails), and the cache invariants. Outputs are compared with a
cache-free reference and across prefix caching on / off / one request at a time.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocm_k3.cache.errors import RequestTooLargeError, TokenBudgetError
from rocm_k3.engine.sequence import Sequence
from tests.cache_sim import Request, SimEngine, reference_outputs, small_config


@st.composite
def workloads(draw, tight: bool = False):
    block = draw(st.sampled_from([4, 8, 16]))
    unit = draw(st.sampled_from([u for u in (1, 2, 4, 8) if block % u == 0]))
    align = unit * draw(st.integers(1, 3))
    max_seqs = draw(st.integers(2 if tight else 1, 4))
    budget = align + max_seqs - 1 + draw(st.integers(0, 24))
    max_len = 64
    min_blocks = -(-max_len // block) + 1
    num_blocks = min_blocks + (0 if tight else draw(st.integers(0, min_blocks // 2)))  # tight: preemptions
    num_slots = draw(st.integers(2, 6))
    bases = [draw(st.lists(st.integers(0, 9), min_size=36, max_size=36)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 7))):
        base = bases[draw(st.integers(0, 1))]
        shared = draw(st.integers(0, 36))
        suffix = draw(st.lists(st.integers(10, 19), min_size=0 if shared else 1, max_size=6))
        prompt = base[:shared] + suffix
        max_tokens = draw(st.integers(1, 20))
        abort = draw(st.integers(0, 12)) if draw(st.integers(0, 3)) == 0 else None
        requests.append(Request(f"r{i}", prompt, max_tokens, arrival_step=draw(st.integers(0, 3)), abort_step=abort))
    return {
        "block": block,
        "unit": unit,
        "align": align,
        "max_seqs": max_seqs,
        "budget": budget,
        "max_len": max_len,
        "num_blocks": num_blocks,
        "num_slots": num_slots,
    }, requests


def _run(params: dict, requests: list[Request], caching: bool, max_seqs: int | None = None, abort: bool = True):
    cfg = small_config(
        caching=caching,
        block=params["block"],
        unit=params["unit"],
        align=params["align"],
        budget=params["budget"],
        max_seqs=max_seqs or params["max_seqs"],
        max_len=params["max_len"],
    )
    reqs = [r if abort else Request(r.request_id, r.prompt, r.max_tokens, r.arrival_step) for r in requests]
    eng = SimEngine(cfg, params["num_blocks"], params["num_slots"], vocab=23, stop_token=0)
    return eng.run(reqs), eng


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_mixes_same_outputs_with_and_without_prefix_caching(workload):
    params, requests = workload
    want = reference_outputs(requests, vocab=23, stop_token=0)
    on, eng_on = _run(params, requests, caching=True)
    off, _ = _run(params, requests, caching=False)
    for r in requests:
        if r.abort_step is None:
            assert on[r.request_id] == want[r.request_id], r.request_id
            assert off[r.request_id] == want[r.request_id], r.request_id
        else:  # aborted requests stop early but never produce a wrong token
            assert on[r.request_id] == want[r.request_id][: len(on[r.request_id])]
            assert off[r.request_id] == want[r.request_id][: len(off[r.request_id])]
    # one request at a time, no aborts, gives the same tokens too
    serial, _ = _run(params, requests, caching=True, max_seqs=1, abort=False)
    assert serial == want
    # cached sequences are all freed at the end; nothing is held
    assert not eng_on.cache.seqs and eng_on.cache.blocks.num_available == eng_on.cache.blocks.size


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(tight=True))
def test_random_mixes_under_memory_pressure(workload):
    params, requests = workload
    want = reference_outputs(requests, vocab=23, stop_token=0)
    for caching in (True, False):
        got, _ = _run(params, requests, caching=caching, abort=False)
        assert got == want


def test_preemption_recomputes_and_keeps_outputs():
    # 7 blocks of 8 = 56 positions for three requests that need up to 44 each: somebody must be preempted
    cfg = small_config(block=8, unit=4, align=8, budget=40, max_seqs=3, max_len=48)
    reqs = [Request(f"r{i}", [i + 1] * 20 + list(range(10)), 14) for i in range(3)]
    eng = SimEngine(cfg, num_blocks=7, num_slots=4, vocab=23)
    assert eng.run(reqs) == reference_outputs(reqs, vocab=23)
    assert eng.sched.num_preemptions > 0


def test_a_hit_whose_copy_on_write_does_not_fit_falls_back_to_whole_blocks():
    """A request that needs the whole pool, whose longest hit ends inside a block: the copy's source block stays
    pinned for the step, one block more than the pool has, so it is admitted on the whole-block part of the hit
    (it was never admitted: "scheduler made no progress")."""
    cfg = small_config(block=8, unit=4, align=8, budget=16, max_seqs=2, max_len=32)
    eng = SimEngine(cfg, num_blocks=4, num_slots=4, vocab=23)
    base = list(range(1, 21))
    first = Request("a", base + [21, 22], 1)  # saves states at 8, 16 and 20 (its last match unit)
    assert eng.run([first]) == reference_outputs([first], vocab=23)
    assert eng.cache.match_length(base + [0] * 12) == 20  # a 20-token hit: 2 blocks + 4 rows copied
    second = Request("b", base + [0] * 12, 1)  # 32 tokens: all 4 blocks
    assert eng.run([second])["b"] == reference_outputs([second], vocab=23)["b"]
    assert eng.seqs["b"].num_cached_tokens == 16 and eng.cache.stats.cow_copies == 0


def test_chunks_end_on_alignment_grid():
    cfg = small_config(block=8, unit=4, align=8, budget=20, max_seqs=1, max_len=64)
    eng = SimEngine(cfg, num_blocks=16, num_slots=4)
    eng.add(Request("a", list(range(60)), 2))
    ends = []
    while eng.sched.has_unfinished():
        out = eng.step()
        ends += [(it.end, it.is_prefill, it.samples) for it in out.scheduled]
    prefill_ends = [e for e, pre, samples in ends if pre and not samples]
    assert prefill_ends == [16, 32, 48]  # budget 20 rounded down to the 8-token grid
    assert [e for e, pre, _ in ends if pre][-1] == 60 and ends[-1] == (61, False, True)


def test_abort_frees_everything():
    cfg = small_config()
    eng = SimEngine(cfg, num_blocks=20, num_slots=4)
    eng.add(Request("a", list(range(30)), 8))
    eng.add(Request("b", list(range(5)), 8))
    eng.step()
    eng.abort("a")
    eng.abort("b")
    eng.check()
    assert eng.seqs["a"].finish_reason == "abort" and not eng.sched.has_unfinished()
    assert not eng.cache.seqs and eng.cache.slots.pool.num_available == 4


def test_request_that_can_never_fit_is_rejected():
    eng = SimEngine(small_config(max_len=64), num_blocks=20, num_slots=4)
    with pytest.raises(RequestTooLargeError, match="max_model_len=64"):
        eng.sched.add(Sequence(seq_id=0, request_id="x", prompt_token_ids=[1] * 60, max_tokens=6))


def test_token_budget_too_small_is_a_named_error():
    with pytest.raises(TokenBudgetError, match="max_num_batched_tokens=10"):
        small_config(align=8, budget=10, max_seqs=4)


def test_request_waits_for_a_shared_prefix_in_flight_instead_of_recomputing_it():
    cfg = small_config(block=8, unit=4, align=8, budget=80, max_seqs=4, max_len=64)
    shared = list(range(100, 140))
    reqs = [Request("a", shared + [1, 2], 3), Request("b", shared + [3], 3), Request("c", [7] * 30, 3)]
    eng = SimEngine(cfg, num_blocks=30, num_slots=12, vocab=50)
    for r in reqs:
        eng.add(r)
    first = eng.step()
    # "a" takes 42 tokens; "b" shares 40 with it and waits; "c" shares nothing and is not held back by "b"
    assert [it.seq.request_id for it in first.scheduled] == ["a", "c"]
    while eng.sched.has_unfinished():
        eng.step()
    assert {k: s.output_token_ids for k, s in eng.seqs.items()} == reference_outputs(reqs, vocab=50)
    assert eng.seqs["b"].num_cached_tokens == 40 and eng.cache.stats.hit_requests == 1
    # without prefix caching nothing waits
    off = SimEngine(small_config(caching=False, block=8, unit=4, align=8, budget=80), 30, 12, vocab=50)
    for r in reqs:
        off.add(r)
    assert [(it.seq.request_id, it.num_new_tokens) for it in off.step().scheduled] == [("a", 42), ("b", 32)]


def _capped(threshold: int, **kw) -> "EngineConfig":
    import dataclasses

    return dataclasses.replace(small_config(**kw), long_prefill_token_threshold=threshold)


def test_long_prefill_token_threshold_caps_each_chunk_on_the_grid():
    """``--long-prefill-token-threshold 12`` on an 8-token grid: chunks of at most 16 tokens (the threshold rounded
    up to the alignment), though the step budget (40) would take 40; the tokens are unchanged."""
    cfg = _capped(12, block=8, unit=4, align=8, budget=40, max_seqs=2, max_len=64)
    assert cfg.prefill_chunk_cap == 16
    eng = SimEngine(cfg, num_blocks=16, num_slots=4)
    reqs = [Request("a", list(range(60)), 3)]
    eng.add(reqs[0])
    ends = []
    while eng.sched.has_unfinished():
        ends += [(it.end, it.is_prefill) for it in eng.step().scheduled]
    assert [e for e, pre in ends if pre] == [16, 32, 48, 60]
    assert eng.seqs["a"].output_token_ids == reference_outputs(reqs)["a"]


def test_long_prefills_share_a_step_with_decodes_and_each_other():
    """Two long prompts arrive while a short one decodes: under a cap of 8 the next step carries the decode and an
    8-token chunk of each (without the cap the first prompt takes 40 of the 48 and the second waits); the largest
    step shrinks from 41 to 17 new tokens; outputs as the reference either way."""
    reqs = [Request("short", [3, 1, 4], 12), Request("long1", list(range(1, 57)), 4),
            Request("long2", list(range(2, 58)), 4)]
    for threshold, first_chunks, largest in ((8, [8, 8], 17), (0, [40], 41)):
        cfg = _capped(threshold, block=8, unit=4, align=8, budget=48, max_seqs=3, max_len=64)
        eng = SimEngine(cfg, num_blocks=24, num_slots=6)
        eng.add(reqs[0])
        eng.step()  # the short prompt is prefilled and decoding
        for r in reqs[1:]:
            eng.add(r)
        sizes, firsts = [], None
        while eng.sched.has_unfinished():
            out = eng.step()
            prefills = [it.end - it.start for it in out.scheduled if it.is_prefill]
            firsts = prefills if firsts is None else firsts
            assert all(n <= cfg.prefill_chunk_cap for n in prefills)
            sizes.append(sum(it.end - it.start for it in out.scheduled))
        assert firsts == first_chunks and max(sizes) == largest, (threshold, firsts, sizes)
        want = reference_outputs(reqs)
        assert {r.request_id: eng.seqs[r.request_id].output_token_ids for r in reqs} == want
        assert not eng.cache.seqs


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_long_prefill_token_threshold_is_validated(bad):
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        _capped(bad)


def test_default_token_budget_is_the_measured_one_and_the_scheduler_honours_it():
    """``--max-num-batched-tokens`` defaults to 1536 everywhere (EngineArgs / the CLI flag, EngineConfig, the
    worker's profiling forward), the budget measured on the H200 to keep decodes' inter-token p99 within 3x of p50
    (issue #35; docs/scheduling.md); its help names the measurement. An engine built without a budget schedules a
    4,000-token prompt in steps of at most 1536 new tokens (the first is exactly 1536: 6 chunks of the K3 alignment
    256), and the tokens match the reference."""
    import dataclasses

    from rocm_k3.args import EngineArgs
    from rocm_k3.engine.config import EngineConfig
    from rocm_k3.settings import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from rocm_k3.worker.worker import WorkerConfig

    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == 1536
    assert EngineArgs().max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig().max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert WorkerConfig.__dataclass_fields__["max_num_batched_tokens"].default == DEFAULT_MAX_NUM_BATCHED_TOKENS
    flag = {f.name: f for f in dataclasses.fields(EngineArgs)}["max_num_batched_tokens"]
    assert "bench_mixed_load" in flag.metadata["help"] and "1536" in flag.metadata["help"]

    cache = small_config(block=16, unit=16, align=256, budget=512, max_len=4096).cache  # its cache config only
    cfg = EngineConfig(max_num_seqs=4, max_model_len=4096, cache=cache)  # the default budget
    eng = SimEngine(cfg, num_blocks=2 * 4096 // 16, num_slots=8)
    reqs = [Request("long", [1 + i % 9 for i in range(4000)], 3), Request("short", [3, 1, 4], 5, arrival_step=1)]
    for r in reqs:
        eng.add(r)
    sizes = []
    while eng.sched.has_unfinished():
        sizes.append(sum(it.end - it.start for it in eng.step().scheduled))
    assert sizes[0] == DEFAULT_MAX_NUM_BATCHED_TOKENS and max(sizes) == DEFAULT_MAX_NUM_BATCHED_TOKENS, sizes
    assert {r.request_id: eng.seqs[r.request_id].output_token_ids for r in reqs} == reference_outputs(reqs)
