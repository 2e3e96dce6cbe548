"""Prefix index and cache manager: hit path, mid-block copy-on-write, LRU eviction, named config errors,
and the invariant checker catching corrupted bookkeeping."""

from __future__ import annotations

import pytest

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.errors import AlignmentError, CacheBudgetError, MatchUnitError
from rocm_k3.cache.invariants import CacheInvariantError, check_invariants
from rocm_k3.cache.manager import CacheManager
from tests.cache_sim import Request, SimEngine, reference_outputs, small_config


def _shared_prefix_run(block: int, unit: int, align: int, prefix_len: int, caching: bool = True):
    cfg = small_config(caching=caching, block=block, unit=unit, align=align, budget=256, max_seqs=2, max_len=1200)
    prefix = [(7 * i) % 97 for i in range(prefix_len)]
    reqs = [Request("first", prefix + [101, 102, 103], 3), Request("second", prefix + [201, 202], 3, arrival_step=1)]
    eng = SimEngine(cfg, num_blocks=200, num_slots=64, vocab=97)
    eng.add(reqs[0])
    while eng.sched.has_unfinished():
        eng.step()
    before = eng.computed_prefill_tokens
    eng.add(reqs[1])
    while eng.sched.has_unfinished():
        eng.step()
    assert {k: s.output_token_ids for k, s in eng.seqs.items()} == reference_outputs(reqs, vocab=97)
    return eng, eng.computed_prefill_tokens - before


@pytest.mark.parametrize(
    "block,unit,align", [(16, 8, 16), (64, 8, 32), (32, 32, 32)], ids=["B16-U8-A16", "B64-U8-A32", "B32-U32-A32"]
)
def test_second_request_skips_shared_1000_token_prefix(block, unit, align):
    eng, second_prefill = _shared_prefix_run(block, unit, align, 1000)
    st = eng.cache.stats
    matched = 1000 // unit * unit  # longest unit multiple inside the shared prefix
    assert st.hit_requests == 1 and st.hit_tokens == matched
    assert second_prefill == 1002 - matched  # only the tail is computed
    assert st.state_restores == 1
    assert st.cow_copies == (1 if matched % block else 0)  # 1000 ends mid-block for B16/B64 (992 % 64 != 0)
    assert eng.seqs["second"].num_cached_tokens == matched
    _, no_cache_prefill = _shared_prefix_run(block, unit, align, 1000, caching=False)
    assert no_cache_prefill == 1002


def _prefill(m: CacheManager, sid: int, toks: list[int], publish: int | None = None) -> list[tuple[int, int]]:
    """Admit and prefill ``toks`` in one chunk; publish the first ``publish`` planned saves (default all)."""
    assert m.admit(sid, toks) == 0
    assert m.ensure_capacity(sid, len(toks))
    saves = m.plan_saves(sid, toks, 0, len(toks), last_chunk=True)
    keep = saves if publish is None else saves[:publish]
    m.commit_prefill(sid, toks, len(toks), keep)
    m.abandon_saves(saves[len(keep) :])
    return saves


def test_saves_at_alignment_points_and_at_the_last_unit_of_a_prefill():
    cfg = CacheConfig(block_size=8, match_unit=4, alignment=8, kda_save_grid=1)
    m = CacheManager(cfg, num_blocks=16, num_slots=8)
    toks = list(range(23))
    m.admit(0, toks)
    m.ensure_capacity(0, 23)
    assert [p for p, _ in m.plan_saves(0, toks, 0, 16, last_chunk=False)] == [8, 16]
    assert [p for p, _ in m.plan_saves(0, toks, 16, 23, last_chunk=True)] == [20]  # 20 = last unit boundary


def test_match_needs_saved_state_and_leaves_one_token():
    cfg = CacheConfig(block_size=8, match_unit=4, alignment=8, kda_save_grid=1)
    toks = list(range(12))
    m = CacheManager(cfg, num_blocks=8, num_slots=4)
    saves = _prefill(m, 0, toks, publish=1)
    assert [p for p, _ in saves] == [8, 12]
    m.free(0)
    assert m.admit(1, toks + [99]) == 8  # units up to 12 are indexed, but only 8 has a saved state
    m = CacheManager(cfg, num_blocks=8, num_slots=4)
    saves = _prefill(m, 0, toks)
    m.free(0)
    assert m.admit(1, toks) == 8  # 12 would leave no token to compute
    assert m.admit(2, toks + [99]) == 12
    assert m.stats.saved_states == 2 and m.stats.cow_copies == 1  # 12 is mid-block (blocks of 8)
    plan = m.take_copies()
    assert plan.state_copies == [(saves[0][1], m.slot(1)), (saves[1][1], m.slot(2))]
    check_invariants(m)
    m.finish_copies(plan)
    check_invariants(m)


def test_mid_block_match_copies_block_and_state():
    cfg = CacheConfig(block_size=8, match_unit=4, alignment=4, kda_save_grid=1)
    m = CacheManager(cfg, num_blocks=8, num_slots=6)
    toks = list(range(16))
    saves = _prefill(m, 0, toks)
    assert [p for p, _ in saves] == [4, 8, 12, 16]
    other = toks[:12] + [50, 51, 52, 53]  # shares 12 tokens = one and a half blocks
    assert m.admit(1, other) == 12
    t0, t1 = m.table(0), m.table(1)
    assert t1[0] == t0[0] and t1[1] != t0[1]  # full block shared, partial block private
    plan = m.take_copies()
    assert plan.block_copies == [(t0[1], t1[1], 4)]
    assert plan.state_copies == [(dict(saves)[12], m.slot(1))]
    assert m.blocks.refcount(t0[0]) == 2
    check_invariants(m, {0: 16, 1: 12})
    m.finish_copies(plan)
    check_invariants(m, {0: 16, 1: 12})


def test_lru_eviction_of_unreferenced_entries():
    cfg = CacheConfig(block_size=4, match_unit=4, alignment=4, kda_save_grid=1)
    m = CacheManager(cfg, num_blocks=4, num_slots=8)
    for sid, base in enumerate((0, 100)):  # two prompts of 2 blocks each, both finished and cached
        toks = list(range(base, base + 8))
        m.admit(sid, toks)
        m.ensure_capacity(sid, 8)
        m.commit_prefill(sid, toks, 8, m.plan_saves(sid, toks, 0, 8, last_chunk=True))
        m.free(sid)
    assert m.blocks.num_evictable == 4 and m.blocks.num_free == 0
    m.admit(2, list(range(200, 208)))
    assert m.ensure_capacity(2, 8)  # evicts the least recently released prompt (0..7)
    assert m.stats.block_evictions == 2
    assert m.admit(3, list(range(8)) + [1]) == 0  # evicted
    assert m.admit(4, list(range(100, 108)) + [1]) == 8  # still cached
    check_invariants(m)


def test_prefix_caching_off_never_matches_or_saves():
    cfg = CacheConfig(block_size=4, match_unit=4, alignment=4, kda_save_grid=1, enable_prefix_caching=False)
    m = CacheManager(cfg, num_blocks=8, num_slots=4)
    toks = list(range(9))
    m.admit(0, toks)
    m.ensure_capacity(0, 9)
    assert m.plan_saves(0, toks, 0, 9, last_chunk=True) == []
    m.commit_prefill(0, toks, 9, [])
    m.free(0)
    assert m.admit(1, toks) == 0 and m.stats.queries == 0
    assert m.blocks.num_free == 8 - len(m.table(1))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            {"block_size": 128, "match_unit": 96, "alignment": 96, "kda_save_grid": 32},
            MatchUnitError,
            "divide block_size",
        ),
        ({"block_size": 128, "match_unit": 32, "alignment": 128}, MatchUnitError, "kda_save_grid"),
        ({"block_size": 128, "match_unit": 64, "alignment": 96}, AlignmentError, "multiple of match_unit"),
        ({"block_size": 0}, ValueError, "block_size"),
    ],
    ids=["unit-not-dividing-block", "unit-off-save-grid", "alignment-not-multiple", "zero-block"],
)
def test_impossible_configs_raise_named_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        CacheConfig(**kwargs)


def test_budget_too_small_for_one_max_length_request():
    cfg = CacheConfig(block_size=128, match_unit=64, alignment=128, kv_cache_bytes=10 * 1000, state_cache_bytes=10**9)
    with pytest.raises(CacheBudgetError, match="needs 33"):  # 4096 / 128 + 1 pinned copy source
        cfg.resolve(bytes_per_block=1000, bytes_per_slot=100, max_model_len=4096)
    cfg = CacheConfig(state_cache_bytes=150)
    with pytest.raises(CacheBudgetError, match="KDA state budget holds 1 slots"):
        cfg.resolve(bytes_per_block=1, bytes_per_slot=100, max_model_len=4096)
    assert CacheConfig(num_blocks=40, num_state_slots=3).resolve(
        bytes_per_block=10**9, bytes_per_slot=10**9, max_model_len=4096
    ) == (40, 3)


def test_invariant_checker_catches_corruption():
    cfg = CacheConfig(block_size=4, match_unit=4, alignment=4, kda_save_grid=1)
    m = CacheManager(cfg, num_blocks=6, num_slots=4)
    toks = list(range(9))
    m.admit(0, toks)
    m.ensure_capacity(0, 9)
    m.commit_prefill(0, toks, 8, m.plan_saves(0, toks, 0, 8, last_chunk=False))
    check_invariants(m, {0: 8})
    m.blocks._ref[m.table(0)[0]] += 1  # a leaked reference
    with pytest.raises(CacheInvariantError, match="refcount 2 != 1"):
        check_invariants(m, {0: 8})
    m.blocks._ref[m.table(0)[0]] -= 1
    m.seqs[0].slot = next(iter(m.index.saved_states()))  # running state aliasing a saved (shared) state
    with pytest.raises(CacheInvariantError, match="also a saved"):
        check_invariants(m, {0: 8})
