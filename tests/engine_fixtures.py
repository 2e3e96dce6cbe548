"""Test support: an EngineCore over an in-process worker serving an already loaded model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rocm_k3.cache.invariants import check_invariants
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.executor.uniproc import UniprocExecutor
from rocm_k3.worker.kv_pools import KVPools
from rocm_k3.worker.worker import WorkerConfig


def core_for(model, config: EngineConfig, *, tokenizer=None, enforce_eager: bool = True,
             model_path: Path = Path("."), output_family: str | None = None, vision_model=None) -> EngineCore:
    """EngineCore for ``model`` (and ``vision_model``, which makes it take images) with the cache sized by
    ``config.cache`` (explicit counts or byte budgets).

    model_path / output_family: where the worker finds the tokenizer for grammars, and their family."""
    worker = WorkerConfig(model_path=model_path, dtype=model.dtype, device=model.device, enforce_eager=enforce_eager,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                          output_family=output_family, speculative=config.speculative)
    executor = UniprocExecutor(worker, model=model, vision_model=vision_model)
    info = executor.info()
    geometry = config.cache.plan(bytes_per_token=info.bytes_per_token, bytes_per_slot=info.bytes_per_slot,
                                 max_model_len=config.max_model_len)
    executor.init_cache(geometry)
    eos = tuple(dict.fromkeys((*info.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
    return EngineCore(config, executor, geometry=geometry, vocab_size=info.vocab_size, eos_token_ids=eos, tokenizer=tokenizer, accepts_images=info.accepts_images)


def pools_of(core: EngineCore) -> KVPools:
    return core.executor.worker.runner.pools


def assert_pools_released(stats: dict) -> None:
    """``stats()`` of an engine whose requests all finished: every KV block and KDA state slot is free or an
    evictable prefix-cache entry (none held by a sequence, a pending save or a speculative per-position state)."""
    assert stats["running"] == stats["waiting"] == 0, stats
    assert stats["free_blocks"] == stats["num_blocks"], f"{stats['num_blocks'] - stats['free_blocks']} blocks held"
    assert stats["free_state_slots"] == stats["num_state_slots"], \
        f"{stats['num_state_slots'] - stats['free_state_slots']} KDA state slots held"


def check_between_steps(core: EngineCore) -> None:
    """The cache invariants of ``core`` between two steps, with every running sequence's computed length."""
    live = {s.seq_id: s.num_computed_tokens for s in core.scheduler.running}
    check_invariants(core.cache_manager, live, between_steps=True)


def run_checked(core: EngineCore) -> dict[str, list[int]]:
    """Step ``core`` until its requests finished, checking the cache after every step and that nothing is held at
    the end (:func:`assert_nothing_held`); the token ids of each request finished meanwhile."""
    done = {}
    while core.has_unfinished():
        for delta in core.step():
            if delta.finished:
                done[delta.request_id] = delta.output.token_ids
        check_between_steps(core)
    assert_nothing_held(core)
    return done


def run_until_raised(core: EngineCore, exc: type[BaseException]) -> dict[str, list[int]]:
    """Step ``core`` until a step raises ``exc`` (it must, before the requests finish); the token ids of each
    request finished before that."""
    done = {}
    with pytest.raises(exc):
        while core.has_unfinished():
            for delta in core.step():
                if delta.finished:
                    done[delta.request_id] = delta.output.token_ids
    return done


def assert_nothing_held(core: EngineCore) -> None:
    """After every request of ``core`` finished: the cache invariants hold, no sequence, running slot or pending
    save is left, the pools are whole again (:func:`assert_pools_released`), and speculation keeps no bookkeeping
    for any sequence."""
    assert not core.has_unfinished()
    check_invariants(core.cache_manager, {}, between_steps=True)
    mgr = core.cache_manager
    assert not mgr.seqs and not mgr.slots.running_slots() and not mgr.pending_saves()
    assert_pools_released(core.stats())
    assert core.scheduler.spec.num_tracked() == 0


def varied_prompts(vocab: int, n: int) -> list[list[int]]:
    """``n`` seeded token-id prompts of 8-40 tokens in four kinds, in turn: a repeated short pattern (n-gram drafts),
    one of four shared prefixes cut at 9-24 tokens then random tokens (prefix-cache hits, at different depths), a
    shared prefix then a repeated pattern (both), random tokens (drafts rarely match)."""
    rng = random.Random(200)
    shared = [[rng.randrange(vocab) for _ in range(24)] for _ in range(4)]
    out = []
    for i in range(n):
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        kind = i % 4
        if kind == 0:
            out.append((pattern * 40)[: rng.randint(8, 40)])
        elif kind == 1:
            tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
            out.append(rng.choice(shared)[: rng.randint(9, 24)] + tail)
        elif kind == 2:
            out.append(rng.choice(shared)[: rng.randint(8, 16)] + (pattern * 20)[: rng.randint(4, 20)])
        else:
            out.append([rng.randrange(vocab) for _ in range(rng.randint(8, 32))])
    return out
