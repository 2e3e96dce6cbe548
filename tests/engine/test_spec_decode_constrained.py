"""Speculative decoding composed with penalties and structured output, on the embedded tiny K3 (fp32, reference ops,
CPU; the harness of ``test_spec_decode``).

Greedy tokens are identical with and without speculation (n-gram and the embedded drafter, k in {1, 3, 7}, prefix
caching, preemption forced) for requests with repetition / presence / frequency penalties, a json_schema, a regex, a
choice, tool_choice required / named and a thinking budget, batched together; drafts are verified and accepted for
them (not decoded one at a time).
Sampled: a verification row's distribution is the penalised / masked one given the drafts before it (chi-square
against the target computed the long way; a row processed without the drafts is caught). The worker confirms the
accepted drafts to the penalties and grammar exactly once (a grammar that saw a draft twice would reject it).
"""

from __future__ import annotations

import collections

import pytest
import torch

from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.structured import StructuredOutputs, tool_call_constraint
from rocm_k3.worker.penalties import PenaltyState, penalty_processor
from rocm_k3.worker.sampler import make_generator, sample
from tests.engine.test_spec_decode import _chi_square_fails, _engine, _prompts, _run, _spec, model  # noqa: F401
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "tags": {"type": "array", "items": {"enum": ["aa", "bb"]}}},
          "required": ["name", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"host": {"enum": ["a", "b"]}}, "required": ["host"]}}}]
CONSTRAINTS = {
    "json_schema": lambda: StructuredOutputs(json=SCHEMA, bare=True),
    "regex": lambda: StructuredOutputs(regex="(ab|ba)+c(xy)*", bare=True),
    "choice": lambda: StructuredOutputs(choice=["hello hello hello hello hello hello", "hello world"], bare=True),
    "tool_required": lambda: StructuredOutputs(tools=tool_call_constraint(TOOLS, "required")),
    "tool_named": lambda: StructuredOutputs(tools=tool_call_constraint(
        TOOLS, {"type": "function", "function": {"name": "get_weather"}})),
}
PENALTIES = dict(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3)


def _grammar_kw() -> dict:
    return dict(model_path=ensure_embedded_model(), output_family="kimi_k3")


def _identical_with_speculation(model, prompts, params, method, *, caching=True, tight=False, **core_kw) -> int:
    """Asserts the greedy outputs match for k in {1, 3, 7}; returns the drafts accepted over the three runs."""
    base = _run(_engine(model, None, caching=caching, tight=tight, **core_kw), prompts, params)
    accepted = preemptions = 0
    for k in (1, 3, 7):
        eng = _engine(model, _spec(method, k), caching=caching, tight=tight, **core_kw)
        got = _run(eng, prompts, params)
        assert got == base, f"k={k}"
        stats = eng.stats()
        assert stats["spec_num_draft_tokens"] > 0, stats  # verified in chunks, not decoded one at a time
        accepted += stats["spec_num_accepted_tokens"]
        preemptions += stats["preemptions"]
    if tight:
        assert preemptions >= 1
    return accepted


@pytest.mark.parametrize("method, tight", [("ngram", False), ("draft_model", True)],
                         ids=["ngram-roomy", "draft_model-preempting"])
def test_greedy_identical_with_penalties(model, method, tight):
    """All three penalties at once (the repetition path and the count path of the processor)."""
    prompts = _prompts(model.cfg.vocab_size, 8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **PENALTIES)
    assert _identical_with_speculation(model, prompts, params, method, tight=tight) > 0


def _encode(text: str) -> list[int]:
    from rocm_k3.tokenizers.loader import load_tokenizer

    return load_tokenizer(ensure_embedded_model()).encode(text)


@pytest.mark.parametrize("method, tight", [("ngram", True), ("draft_model", False)],
                         ids=["ngram-preempting", "draft_model-roomy"])
def test_greedy_identical_with_structured_output(model, method, tight):
    """Every constraint kind batched together, some with penalties, one still thinking under a budget (it uses one
    position per step until think ends). The drafter proposes what the unconstrained model would say, so under a
    grammar most of its drafts are masked out of their rows and rejected (the identity still holds); n-gram drafts
    of the repetitive outputs are accepted."""
    texts = ("hello hello hello hello", "ab ab ab ab ab ab")
    prompts, params = [], []
    for name, make in CONSTRAINTS.items():
        for i, text in enumerate(texts):
            penalties = dict(frequency_penalty=0.3, repetition_penalty=1.1) if i else {}
            prompts.append(_encode(text))
            params.append(SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=make(), **penalties))
    prompts.append(_encode("Give me the data as JSON."))
    params.append(SamplingParams(temperature=0.0, max_tokens=30, prompt_in_think=True, thinking_token_budget=3,
                                 structured_outputs=CONSTRAINTS["regex"]()))
    accepted = _identical_with_speculation(model, prompts, params, method, tight=tight, **_grammar_kw())
    if method == "ngram":
        assert accepted > 0


# ---- sampled: the verification rows' distributions are the penalised / masked ones -----------------------------
V = 6
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def _rows_after_drafts(params: SamplingParams, drafts: tuple[int, ...], seed: int, ahead_broken: bool) -> list[int]:
    """The tokens of a verification chunk's rows (same logits each row) processed by the penalties as after the
    drafts before each row (``ahead_broken``: every row processed as the first, the bug this guards)."""
    state = PenaltyState(params, [])
    rows = 1 + len(drafts)
    ahead = [drafts[:j] for j in range(rows)] if not ahead_broken else [()] * rows
    gen = make_generator(seed)
    processor = penalty_processor([params] * rows, [state] * rows, ahead)  # None when nothing is counted
    out = sample(LOGITS.repeat(rows, 1), [params] * rows, [gen] * rows, [processor] if processor else [])
    return out.token_ids.tolist()


def _second_token_matches_target(ahead_broken: bool, n: int = 4000) -> bool:
    """Row 1 (after draft 0) sampled with penalties: its distribution must be the target's with draft 0 counted."""
    params = SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=1.5, presence_penalty=0.5)
    draft = 0
    counts = collections.Counter(_rows_after_drafts(params, (draft,), seed, ahead_broken)[1] for seed in range(n))
    penalised = LOGITS.clone()
    penalised[draft] -= 1.5 + 0.5
    probs = torch.softmax(penalised, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[(probs[order].cumsum(0) - probs[order]) < 0.9]] = True
    probs = torch.where(keep, probs, torch.zeros(()))
    probs = probs / probs.sum()
    stat, critical = _chi_square_fails(counts, {t: float(probs[t]) for t in range(V)}, n)
    return stat < critical


def test_verification_rows_sample_the_penalised_distribution():
    assert _second_token_matches_target(ahead_broken=False)


def test_rows_processed_without_the_drafts_are_caught():
    assert not _second_token_matches_target(ahead_broken=True)
