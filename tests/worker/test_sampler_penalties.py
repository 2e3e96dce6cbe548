"""min-p, the repetition / presence / frequency penalties and logits processors in the sampler (worker side),
checked against direct formulas; rows never depend on their batch mates; the raw logprobs stay raw."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import seeded

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.penalties import PenaltyState, penalty_processor
from rocm_k3.worker.request_state import RequestState
from rocm_k3.worker.sampler import make_generator, sample
from rocm_k3.worker.step_io import ScheduledChunk


def _logits(n: int = 3, vocab: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=seeded(seed)) * 3


def _reference_penalized(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The textbook definitions, one token at a time."""
    out = row.clone().double()
    for tok in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(output):
        count = output.count(tok)
        out[tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_match_the_definitions_row_by_row() -> None:
    logits = _logits(n=3)
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.9),
              SamplingParams(temperature=0),  # no penalties: untouched
              SamplingParams(temperature=0, frequency_penalty=-1.5)]
    prompts = [[1, 2, 3, 3], [4], [5, 6]]
    outputs = [[3, 7, 7, 9], [4, 4], [6, 6, 6, 8]]
    states = []
    for p, prompt, out in zip(params, prompts, outputs):
        s = PenaltyState(p, prompt) if p.has_penalties else None
        if s is not None:
            s.add(out[:2])
            s.add(out[2:])
        states.append(s)
    processed = logits.clone()
    penalty_processor(params, states)(processed)
    for i in range(3):
        ref = _reference_penalized(logits[i], params[i], prompts[i], outputs[i]) if states[i] else logits[i].double()
        assert torch.allclose(processed[i].double(), ref, rtol=1e-6, atol=1e-6), i
    # the presence/frequency penalties count only output tokens: a prompt-only token keeps its logit
    assert processed[2, 5] == logits[2, 5]


def test_no_penalties_no_processor() -> None:
    assert penalty_processor([SamplingParams()] * 2, [None, None]) is None


def test_greedy_with_penalties_avoids_repeats_and_leaves_batch_mates_alone() -> None:
    logits = torch.zeros(2, 6)
    logits[:, 2] = 5.0
    logits[:, 4] = 4.0
    pen = SamplingParams(temperature=0, presence_penalty=2.0)
    plain = SamplingParams(temperature=0)
    state = PenaltyState(pen, [])
    state.add([2])
    proc = penalty_processor([pen, plain], [state, None])
    out = sample(logits, [pen, plain], [make_generator(0)] * 2, [proc])
    assert out.token_ids.tolist() == [4, 2]  # 5 - 2 < 4 for the penalized row only
    # logprobs stay those of the raw logits
    out = sample(logits[:1], [SamplingParams(temperature=0, presence_penalty=2.0, logprobs=0)], [make_generator(0)],
                 [penalty_processor([pen], [state])])
    raw = torch.log_softmax(logits[0].double(), -1)
    assert math.isclose(out.logprobs[0][4], float(raw[4]), rel_tol=1e-6)


def test_min_p_restricts_the_support() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.4 keeps tokens with p >= 0.2 = {0, 1}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = make_generator(3)
    seen = {int(sample(logits, [SamplingParams(min_p=0.4)], [gen]).token_ids[0]) for _ in range(300)}
    assert seen == {0, 1}
    seen = {int(sample(logits, [SamplingParams(min_p=0.0)], [gen]).token_ids[0]) for _ in range(600)}
    assert seen == {0, 1, 2, 3}


def test_min_p_rows_are_independent() -> None:
    logits = _logits(n=4)
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=5)
    alone = [int(sample(logits[[1]], [p], [make_generator(5)]).token_ids[0]) for _ in range(5)]
    mixed = [int(sample(logits, [SamplingParams(), p, SamplingParams(min_p=0.9), SamplingParams(temperature=0)],
                        [make_generator(9), make_generator(5), make_generator(1), make_generator(2)]).token_ids[1])
             for _ in range(5)]
    assert alone == mixed


def test_processors_edit_a_copy() -> None:
    logits = _logits(n=2)
    before = logits.clone()

    def ban_argmax(x: torch.Tensor) -> None:
        x[0, int(before[0].argmax())] = float("-inf")

    out = sample(logits, [SamplingParams(temperature=0)] * 2, [make_generator(0)] * 2, [ban_argmax])
    assert torch.equal(logits, before)
    assert int(out.token_ids[0]) == int(before[0].topk(2).indices[1])
    assert int(out.token_ids[1]) == int(before[1].argmax())
    assert out.finite.tolist() == [True, True]  # a masked -inf is not a non-finite model output


def test_request_state_confirms_each_output_token_once() -> None:
    state = RequestState("r", SamplingParams(), make_generator(0), num_prompt_tokens=5)

    def chunk(tokens, start):
        return ScheduledChunk("r", tuple(tokens), start, False, (), 0, True, True)

    assert state.observe(chunk([1, 2, 3], 2)) == []  # prompt (after a cached prefix of 2)
    assert state.observe(chunk([4, 5], 3)) == []  # positions 3, 4: the rest of the prompt
    assert state.observe(chunk([6], 5)) == [6]  # position 5: the first output token, confirmed by its decode
    # a recomputation after a preemption repeats everything known, then brings the newest token
    assert state.observe(chunk([1, 2, 3, 4, 5, 6, 7], 0)) == [7]
    assert state.observe(chunk([8], 7)) == [8]
    assert state.observe(chunk([8], 7)) == []  # a step sent again after a failure


@pytest.mark.parametrize("kwargs, match", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"thinking_token_budget": 4}, "prompt_in_think"),
    ({"thinking_token_budget": -1, "prompt_in_think": True}, "thinking_token_budget"),
    ({"structured_outputs": {"regex": "a"}}, "structured_outputs"), ({"prompt_in_think": 1}, "prompt_in_think"),
])
def test_new_fields_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ignore_eos_with_a_grammar_is_refused() -> None:
    from rocm_k3.structured import StructuredOutputs

    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a+"))
