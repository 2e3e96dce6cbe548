"""EngineCore on the tiny K3 model (fp32, reference ops): prefix caching changes no output, the hit path runs
(saved KDA state restored, mid-block copy-on-write), cache invariants hold after every step, and cached
entries (saved states, indexed KV rows) are never written in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.errors import CacheBudgetError, RequestTooLargeError
from rocm_k3.cache.invariants import check_invariants
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from tests.engine_fixtures import core_for, pools_of
from tests.helpers import seeded
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny_k3_engine")
    write_tiny_checkpoint(root, seed=11)
    return load_model(root, dtype=torch.float32, progress=False)


def _engine(
    model,
    caching: bool,
    *,
    max_seqs: int = 4,
    budget: int = 48,
    block: int = 16,
    unit: int = 8,
    align: int = 16,
    grid: int = 8,
    num_blocks: int = 40,
    num_slots: int = 24,
    max_len: int = 80,
):
    cache = CacheConfig(
        block_size=block,
        match_unit=unit,
        alignment=align,
        kda_save_grid=grid,
        enable_prefix_caching=caching,
        num_blocks=num_blocks,
        num_state_slots=num_slots,
    )
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len, cache=cache)
    return core_for(model, cfg)


def _snapshot_cache_entries(engine: EngineCore):
    """Saved KDA states and indexed KV rows as they are now (to check nothing writes them in place)."""
    mgr, cache = engine.cache_manager, pools_of(engine)
    states = {s: (node, cache.kda_state(0)[s].clone(), cache.conv_state(0)[s].clone())
              for s, node in mgr.index.saved_states().items()}
    u, bs = mgr.match_unit, mgr.block_size
    rows = {}  # by node: a block evicted and reused holds another node's rows (not a write in place)
    for node in mgr.index.nodes():
        off = (node.depth - 1) * u % bs
        rows[node] = (node.block, off, cache.mla_kv(0)[node.block, off : off + u].clone())
    return states, rows


def _check_entries_unchanged(engine: EngineCore, before) -> None:
    states, rows = before
    mgr, cache = engine.cache_manager, pools_of(engine)
    still_saved = mgr.index.saved_states()
    for s, (node, rec, conv) in states.items():
        if still_saved.get(s) is node:  # the same entry (an evicted slot may hold a new one)
            assert torch.equal(cache.kda_state(0)[s], rec), f"saved KDA state {s} was written in place"
            assert torch.equal(cache.conv_state(0)[s], conv), f"saved conv state {s} was written in place"
    u = mgr.match_unit
    live = set(mgr.index.nodes())
    for node, (block, off, value) in rows.items():
        if node in live:
            assert torch.equal(cache.mla_kv(0)[block, off : off + u], value), f"cached KV rows {block, off} changed"


def _run(engine: EngineCore, requests, aborts=None) -> dict[str, list[int]]:
    """requests: (request_id, prompt, arrival step); aborts: request_id -> step. Checks invariants every step."""
    aborts = aborts or {}
    pending = sorted(requests, key=lambda r: r[2])
    outputs: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][2] <= step:
            rid, prompt, _ = pending.pop(0)
            engine.add_request(rid, prompt, GREEDY)
        for rid, when in aborts.items():
            if when == step and rid not in outputs:
                seq = engine._seqs.get(rid)
                if seq is not None:
                    outputs[rid] = list(seq.output_token_ids)
                    engine.abort(rid)
        if engine.has_unfinished():
            before = _snapshot_cache_entries(engine)
            for done in engine.step():
                if done.finished:
                    outputs[done.request_id] = done.output.token_ids
                    logprobs[done.request_id] = [next(iter(d.values())) for d in done.output.logprobs]
            _check_entries_unchanged(engine, before)
            check_invariants(
                engine.cache_manager,
                {s.seq_id: s.num_computed_tokens for s in engine.scheduler.running},
                between_steps=True,
            )
        step += 1
    engine.last_logprobs = logprobs
    return outputs


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=seeded(seed)).tolist()


@st.composite
def request_mixes(draw, vocab: int):
    bases = [_ids(40, draw(st.integers(0, 10**6)), vocab) for _ in range(2)]
    n = draw(st.integers(2, 6))
    order = draw(st.permutations(range(n)))  # arrival order
    group = draw(st.integers(1, 2))  # 2: requests arrive in pairs
    requests, aborts = [], {}
    for i in range(n):
        shared = draw(st.sampled_from([0, 7, 8, 16, 24, 29, 32, 40, 40]))  # ends off/on units, mid/at blocks
        tail = _ids(draw(st.integers(1, 5)), draw(st.integers(0, 10**6)), vocab)
        requests.append((f"r{i}", bases[draw(st.integers(0, 1))][:shared] + tail, order[i] // group))
        if draw(st.integers(0, 4)) == 0:
            aborts[f"r{i}"] = draw(st.integers(1, 6))
    tight = draw(st.booleans())
    return requests, aborts, tight


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_mixes_identical_with_prefix_caching_on_and_off(model, data):
    requests, aborts, tight = data.draw(request_mixes(model.cfg.vocab_size))
    # tight: 7 blocks of 16 (the minimum for max_model_len 80 + a COW source) for up to six ~45-token
    # requests -> preemption and recompute
    blocks = 7 if tight else 40
    on = _run(_engine(model, True, num_blocks=blocks), requests, aborts)
    off = _run(_engine(model, False, num_blocks=blocks), requests, aborts)
    for rid, _, _ in requests:
        if rid in aborts:
            n = min(len(on[rid]), len(off[rid]))
            assert on[rid][:n] == off[rid][:n], rid
        else:
            assert on[rid] == off[rid], rid


def test_batched_with_cache_equals_one_request_at_a_time(model):
    vocab = model.cfg.vocab_size
    base = _ids(44, 1, vocab)
    requests = [
        ("a", base + [5, 6], 0),
        ("b", base[:20] + [7], 0),
        ("c", base + [5, 6, 9], 1),
        ("d", _ids(36, 2, vocab), 1),
        ("e", base[:28], 2),
    ]
    eng = _engine(model, True, num_blocks=7)  # tight enough to preempt
    batched = _run(eng, requests)
    stats = eng.stats()
    assert stats["hit_requests"] >= 2 and stats["cow_copies"] >= 1 and stats["preemptions"] >= 1, stats
    serial = {}
    for rid, prompt, _ in requests:  # each request alone, on a fresh engine without prefix caching
        serial.update(_run(_engine(model, False, max_seqs=1), [(rid, prompt, 0)]))
    assert batched == serial


def test_shared_1000_token_prefix_skips_prefill_with_mid_block_copy(model):
    # kernel-realistic granularities: states on the 64-token grid, blocks of 128, chunks aligned to 128
    eng = _engine(
        model, True, block=128, unit=64, align=128, grid=64, budget=640, num_blocks=20, num_slots=24, max_len=1100
    )
    prompt = _ids(1000, 3, model.cfg.vocab_size) + [11, 12, 13]
    first = _run(eng, [("first", prompt, 0)])
    first_lp = eng.last_logprobs["first"]
    computed = eng.stats()["prefill_tokens"]
    second = _run(eng, [("second", prompt, 0)])
    stats = eng.stats()
    assert second["second"] == first["first"]
    assert eng.last_logprobs["second"] == pytest.approx(first_lp, abs=1e-4)
    assert stats["hit_tokens"] == 960 and stats["state_restores"] == 1  # 1002 // 64 * 64: one token left
    assert stats["cow_copies"] == 1  # 960 = 7.5 blocks of 128: the half block is copied
    assert stats["prefill_tokens"] - computed == 1003 - 960


def test_seeded_sampling_is_the_same_with_and_without_prefix_caching(model):
    vocab = model.cfg.vocab_size
    base = _ids(40, 4, vocab)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=123, max_tokens=5, ignore_eos=True)
    outs = []
    for caching in (True, False):
        eng = _engine(model, caching)
        eng.add_request("a", base + [3], params)
        eng.step()  # "a" is prefilled (and, with caching, its states saved) before "b" arrives
        eng.add_request("b", base + [4, 5], params)
        outs.append({k: v.token_ids for k, v in eng.run_to_completion().items()})
        if caching:
            assert eng.stats()["hit_tokens"] == 40
    assert outs[0] == outs[1]


def test_named_errors_and_length_cap(model):
    with pytest.raises(CacheBudgetError, match="KV budget"):
        core_for(model, EngineConfig(max_model_len=4096, cache=CacheConfig(kv_cache_bytes=10_000)))
    eng = _engine(model, True, max_len=40)
    with pytest.raises(RequestTooLargeError, match="max_model_len=40"):
        eng.add_request("long", list(range(1, 42)), GREEDY)
    eng.add_request("fits", list(range(1, 39)), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    out = eng.run_to_completion()["fits"]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"  # 38 + 3 - 1 = 40 positions


class _FailOnce:
    """Wraps the model; its n-th forward raises after running (a failure once cache state was already written)."""

    def __init__(self, model, fail_at: int) -> None:
        self.inner, self.calls, self.fail_at = model, 0, fail_at
        self.cfg, self.dtype, self.device = model.cfg, model.dtype, model.device

    def forward(self, batch, cache):
        self.calls += 1
        logits = self.inner.forward(batch, cache)
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return logits


@pytest.mark.parametrize("fail_at", [1, 2, 4], ids=["first-prefill", "second-step", "decode"])
def test_failed_step_requeues_its_requests_and_outputs_are_unchanged(model, fail_at):
    vocab = model.cfg.vocab_size
    base = _ids(40, 9, vocab)
    requests = [("a", base + [1], 0), ("b", base + [2, 3], 1), ("c", _ids(20, 10, vocab), 1)]
    want = _run(_engine(model, False), requests)
    flaky = _engine(model, True)
    flaky.executor.worker.runner.model = _FailOnce(model, fail_at)
    outputs, failures, step = {}, 0, 0
    while step < 2 or flaky.has_unfinished():
        for rid, prompt, arrival in requests:
            if arrival == step:
                flaky.add_request(rid, prompt, GREEDY)
        try:
            outputs.update((done.request_id, done.output.token_ids) for done in flaky.step() if done.finished)
        except RuntimeError as err:
            assert "injected failure" in str(err)
            failures += 1
        check_invariants(
            flaky.cache_manager,
            {s.seq_id: s.num_computed_tokens for s in flaky.scheduler.running},
            between_steps=True,
        )
        step += 1
    assert failures == 1 and outputs == want


def test_multi_turn_resumes_at_the_last_unit_of_the_previous_prompt(model):
    vocab = model.cfg.vocab_size
    turn1 = _ids(45, 12, vocab)
    outs = {}
    for caching in (True, False):
        eng = _engine(model, caching)
        eng.add_request("t1", turn1, GREEDY)
        reply = eng.run_to_completion()["t1"].token_ids
        eng.add_request("t2", turn1 + reply + _ids(6, 13, vocab), GREEDY)
        outs[caching] = (reply, eng.run_to_completion()["t2"].token_ids)
        if caching:  # states saved at 16, 32 (alignment) and 40 (turn 1's last 8-token unit)
            assert eng.stats()["hit_tokens"] == 40 and eng.stats()["cow_copies"] == 1
    assert outs[True] == outs[False]
