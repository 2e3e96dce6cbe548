"""A SIGTERM or an abort that arrives during a verification step (issue #33): the step is abandoned as a whole
(its per-position state slots given back, the drafter's proposals as before it), the aborted request frees its
blocks and slot, the others finish with the tokens they get without speculation, and nothing is held at the end.

The SIGTERM is real (``os.kill`` of this process) with a handler that raises, as a server's shutdown hook or an
embedding application's may; it is delivered inside the worker's part of the step, before or after the verifying
forward. Both proposers; prefix caching on.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER, SpeculativeConfig
from tests.engine_fixtures import check_between_steps, core_for, run_checked, run_until_raised, varied_prompts
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class Terminated(Exception):
    """What this test's SIGTERM handler raises."""


@pytest.fixture(scope="module")
def model():
    return load_model(ensure_embedded_model(), dtype=torch.float32, progress=False)


@pytest.fixture
def sigterm_raises():
    def handler(signum, frame):
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _engine(model, spec: SpeculativeConfig | None):
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, num_blocks=64,
                        num_state_slots=64)
    cfg = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=96, cache=cache, speculative=spec)
    return core_for(model, cfg)


def _prompts(model) -> list[list[int]]:
    return varied_prompts(model.cfg.vocab_size, 8)


@pytest.fixture(scope="module")
def greedy(model) -> dict[str, list[int]]:
    eng = _engine(model, None)
    for i, p in enumerate(_prompts(model)):
        eng.add_request(str(i), p, GREEDY)
    return {r: o.token_ids for r, o in eng.run_to_completion().items()}


def _interrupt_first_verification(eng, when: str) -> list[str]:
    """Make the first step that verifies drafts receive a SIGTERM inside the executor (``when``: before or after
    its forward); returns, once it fired, the ids of the requests that step was verifying."""
    execute = eng.executor.execute
    verifying: list[str] = []

    def interrupted(step):
        if verifying or not any(c.num_draft for c in step.chunks):
            return execute(step)
        verifying.extend(c.request_id for c in step.chunks if c.num_draft)
        if when == "after":
            execute(step)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs between bytecodes
            pass
        raise AssertionError("the SIGTERM handler did not run")

    eng.executor.execute = interrupted
    return verifying


@pytest.mark.usefixtures("sigterm_raises")
@pytest.mark.parametrize("when", ["before", "after"], ids=["before-forward", "after-forward"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sigterm_during_a_verification_then_abort_leaks_nothing(model, greedy, method, when):
    spec = SpeculativeConfig(method=method, model=EMBEDDED_DRAFTER if method == "draft_model" else None,
                             num_speculative_tokens=3)
    eng = _engine(model, spec)
    for i, p in enumerate(_prompts(model)):
        eng.add_request(str(i), p, GREEDY)
    verifying = _interrupt_first_verification(eng, when)
    done = run_until_raised(eng, Terminated)
    assert verifying, "no step verified drafts"
    check_between_steps(eng)  # the abandoned verification holds no per-position slot and no pending save
    assert eng.scheduler.spec.num_tracked() <= len(verifying)
    victim = verifying[0]  # the abort arrives for a request whose verification was cut short
    assert eng.abort(victim)
    done.update(run_checked(eng))
    assert victim not in done
    assert done == {r: t for r, t in greedy.items() if r != victim}
    assert eng.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_abort_arriving_during_a_verification_frees_its_slots(model, greedy, method):
    """An abort that comes in while a verification runs is applied when the step returns (the engine's caller
    serialises it after the step): every request whose drafts that step verified is aborted then."""
    spec = SpeculativeConfig(method=method, model=EMBEDDED_DRAFTER if method == "draft_model" else None,
                             num_speculative_tokens=3)
    eng = _engine(model, spec)
    for i, p in enumerate(_prompts(model)):
        eng.add_request(str(i), p, GREEDY)
    execute = eng.executor.execute
    verified: list[str] = []

    def record(step):
        verified[:] = [c.request_id for c in step.chunks if c.num_draft]
        return execute(step)

    eng.executor.execute = record
    done: dict[str, list[int]] = {}
    while not verified:
        for d in eng.step():
            if d.finished:
                done[d.request_id] = d.output.token_ids
    aborted = {rid for rid in verified if rid not in done}
    assert aborted
    for rid in aborted:
        assert eng.abort(rid)
    check_between_steps(eng)
    done.update(run_checked(eng))
    assert done == {r: t for r, t in greedy.items() if r not in aborted}
