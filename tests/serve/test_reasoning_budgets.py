"""reasoning_effort -> K3's effort note and a think-token budget: per-effort defaults, the server flag that
changes them, a request's thinking_token_budget winning, "none" turning thinking off."""

from __future__ import annotations

import pytest

from rocm_k3.args import ServerArgs
from rocm_k3.engine.chat import ChatRequest, ModelFrontend
from rocm_k3.formats.chat_base import DEFAULT_EFFORT_BUDGETS, parse_effort_budgets
from rocm_k3.formats.parsers.registry import checkpoint_family
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.tokenizers import load_tokenizer

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def path():
    return ensure_embedded_model()


def _frontend(path, budgets=None) -> ModelFrontend:
    return ModelFrontend(path, load_tokenizer(path), checkpoint_family(path), budgets)


@pytest.mark.parametrize("effort,k3_effort", [("minimal", "low"), ("low", "low"), ("medium", "high"),
                                               ("high", "high")])
def test_effort_sets_note_and_default_budget(path, effort, k3_effort) -> None:
    prepared = _frontend(path).prepare_chat(ChatRequest(USER, reasoning_effort=effort))
    assert f"thinking_effort={k3_effort}" in prepared.prompt_text and prepared.prompt_in_think
    params = prepared.sampling(SamplingParams(max_tokens=8))
    assert params.thinking_token_budget == DEFAULT_EFFORT_BUDGETS[effort]


def test_flag_budgets_and_request_budget_win(path) -> None:
    budgets = parse_effort_budgets(ServerArgs(reasoning_effort_budgets="low=32, medium=99").reasoning_effort_budgets)
    assert budgets["low"] == 32 and budgets["medium"] == 99 and budgets["high"] == DEFAULT_EFFORT_BUDGETS["high"]
    frontend = _frontend(path, budgets)
    assert frontend.prepare_chat(ChatRequest(USER, reasoning_effort="low")).sampling(
        SamplingParams()).thinking_token_budget == 32
    exact = frontend.prepare_chat(ChatRequest(USER, reasoning_effort="low", thinking_token_budget=5))
    assert exact.sampling(SamplingParams()).thinking_token_budget == 5
    plain = frontend.prepare_chat(ChatRequest(USER))  # no effort: no budget
    assert plain.sampling(SamplingParams()).thinking_token_budget is None
    off = frontend.prepare_chat(ChatRequest(USER, reasoning_effort="none"))
    assert not off.thinking and off.sampling(SamplingParams()).thinking_token_budget is None


@pytest.mark.parametrize("bad", ["low", "low=x", "huge=5", "low=-1"])
def test_bad_budget_flag_is_named(bad) -> None:
    with pytest.raises(ValueError, match="reasoning_effort_budgets"):
        ServerArgs(reasoning_effort_budgets=bad)
