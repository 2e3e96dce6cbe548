"""Sampler and SamplingParams: greedy, seeded draws, top-k/top-p supports, empirical distribution, logprobs, stops."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import seeded

from rocm_k3.worker.sampler import make_generator, sample
from rocm_k3.sampling_params import SamplingParams


def _logits(n: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=seeded(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    out = sample(logits, [SamplingParams(temperature=0)] * 3, [make_generator(0)] * 3)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs == [None, None, None]


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=2.0, top_k=1)] * 3
    gens = [make_generator(i) for i in range(3)]
    assert sample(logits, params, gens).token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_draws_are_reproducible_and_batch_independent() -> None:
    logits = _logits(n=4)
    p = SamplingParams(temperature=1.0, seed=7)

    def draws(rows: list[int], position: int) -> list[int]:
        gens = [make_generator(7) for _ in rows]
        return [int(sample(logits[rows], [p] * len(rows), gens).token_ids[position]) for _ in range(20)]

    alone = draws([2], 0)
    assert alone == draws([0, 2, 3], 1)  # row 2 second in a larger batch draws the same tokens
    assert alone == draws([2], 0)  # and the same seed reproduces them
    assert len(set(alone)) > 1  # the generator advances between draws


def test_top_p_and_top_k_restrict_the_support() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1}; top_k 3 keeps {0, 1, 2}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = make_generator(1)
    for params, support in ((SamplingParams(top_p=0.7), {0, 1}), (SamplingParams(top_k=3), {0, 1, 2})):
        seen = {int(sample(logits, [params], [gen]).token_ids[0]) for _ in range(300)}
        assert seen == support


def test_empirical_distribution_matches_softmax() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = (torch.log(probs) * 2.0)[None]  # temperature 2 undoes the factor 2
    gen, n = make_generator(3), 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[int(sample(logits, [SamplingParams(temperature=2.0)], [gen]).token_ids[0])] += 1
    # 5 standard deviations of a binomial count: fails on a wrong distribution, not on sampling noise
    bound = 5 * torch.sqrt(n * probs * (1 - probs))
    assert ((counts - n * probs).abs() <= bound).all(), counts.tolist()


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = _logits(n=2)
    out = sample(logits, [SamplingParams(temperature=0.7, logprobs=3, seed=1)] * 2,
                 [make_generator(1), make_generator(2)])
    ref = torch.log_softmax(logits.double(), -1)
    for row in range(2):
        entry = out.logprobs[row]
        chosen = int(out.token_ids[row])
        assert next(iter(entry)) == chosen
        top3 = set(torch.topk(ref[row], 3).indices.tolist())
        assert top3 <= set(entry) and len(entry) <= 4
        for tok, lp in entry.items():
            assert math.isclose(lp, float(ref[row, tok]), rel_tol=1e-5, abs_tol=1e-5)


def test_non_finite_rows_are_flagged_and_leave_other_rows_alone() -> None:
    logits = _logits(n=3)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    params = [SamplingParams(temperature=0.0)] * 3
    out = sample(logits, params, [make_generator(0)] * 3)
    assert out.finite.tolist() == [True, False, False]
    assert int(out.token_ids[0]) == int(logits[0].argmax())


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 - 1, True])
def test_generator_seed_out_of_range_is_named(seed) -> None:
    with pytest.raises(ValueError, match="seed"):
        make_generator(seed)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"seed": 1.5}, "seed"),
     ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logprobs": -1}, "logprobs"),
     ({"ignore_eos": 1}, "ignore_eos")],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else v,
)
def test_sampling_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sample_validates_inputs() -> None:
    with pytest.raises(TypeError, match="float32"):
        sample(_logits().half(), [SamplingParams()] * 3, [make_generator(0)] * 3)
    with pytest.raises(ValueError, match="one per row"):
        sample(_logits(), [SamplingParams()], [make_generator(0)])


@pytest.mark.parametrize("case", ["inf_logit", "nan_after_penalty", "two_infs"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_extreme_processed_logits_never_draw_from_nan(case: str, temperature: float) -> None:
    """An extreme penalty can turn processed logits into +-inf or NaN (x / 1e-30, inf - inf); the pick is then the
    top non-NaN logit, never token 0 from a NaN distribution (the 'NUL token' of issue 31)."""
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) - 10  # token 0 is not special
    best = 17

    def extreme(x: torch.Tensor) -> None:
        if case == "inf_logit":
            x[0, best] = float("inf")
        elif case == "nan_after_penalty":
            x[0, :best] = float("nan")
            x[0, best] = 1e30
            x[0, best + 1:] = float("nan")
        else:
            x[0, best] = float("inf")
            x[0, best + 5] = float("inf")
            x[0, 3] = float("nan")

    params = [SamplingParams(temperature=temperature, top_p=1e-9, min_p=0.999)]
    for seed in range(5):
        out = sample(logits, params, [make_generator(seed)], [extreme])
        assert int(out.token_ids[0]) == best, (case, seed, int(out.token_ids[0]))
        assert bool(out.finite[0])  # the model's own logits were finite: the request is not failed
        # a fallback (counted in /metrics) unless greedy had a well-defined pick (an inf logit and no NaN)
        assert bool(out.fallback[0]) == (temperature > 0 or case != "inf_logit")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fallback_is_flagged_per_row_and_an_empty_row_takes_the_model_top_logit(temperature: float) -> None:
    """Row 0 healthy, row 1 processed to all NaN (nothing left: the model's top logit, not token 0), row 2 with a
    NaN model logit (a failed request, not a fallback), row 3 fully masked by a processor."""
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(5)) - 10
    logits[:, 9] = 5.0  # the model's top logit in every row; token 0 is never it
    logits[2, 4] = float("nan")

    def breaks_rows(x: torch.Tensor) -> None:
        x[1] = float("nan")
        x[3] = float("-inf")

    params = [SamplingParams(temperature=temperature, seed=1)] * 4
    out = sample(logits, params, [make_generator(i) for i in range(4)], [breaks_rows])
    assert out.fallback.tolist() == [False, True, False, True]
    assert out.finite.tolist() == [True, True, False, True]
    assert int(out.token_ids[1]) == 9 and int(out.token_ids[3]) == 9


def test_tiny_top_p_and_min_p_are_not_fallbacks() -> None:
    """Extreme but valid values keep the most likely token in the support: a real distribution, no fallback."""
    logits = _logits(n=2)
    params = [SamplingParams(temperature=1.0, top_p=1e-9, seed=0), SamplingParams(temperature=2.0, min_p=1.0, seed=0)]
    out = sample(logits, params, [make_generator(0), make_generator(1)])
    assert out.fallback.tolist() == [False, False]
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_prompt_token_logprobs_in_slices_match_one_log_softmax() -> None:
    """Rows past one slice (PROMPT_LOGPROB_ROWS) give what one log_softmax over all rows gives."""
    from rocm_k3.worker import sampler

    m, vocab = sampler.PROMPT_LOGPROB_ROWS + 7, 50
    logits = torch.randn(m, vocab, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, vocab, (m,), generator=torch.Generator().manual_seed(1)).tolist()
    entries, ranks = sampler.prompt_token_logprobs(logits, targets, [2] * m)
    logp = torch.log_softmax(logits, dim=-1)
    for i in (0, sampler.PROMPT_LOGPROB_ROWS - 1, sampler.PROMPT_LOGPROB_ROWS, m - 1):
        entry = dict(entries[i])
        assert next(iter(entry)) == targets[i] and abs(entry[targets[i]] - logp[i, targets[i]].item()) < 1e-5
        assert ranks[i] == int((logp[i] > logp[i, targets[i]]).sum()) + 1
        top2 = logp[i].topk(2).indices.tolist()
        assert set(top2) <= set(entry) and len(entry) <= 3
