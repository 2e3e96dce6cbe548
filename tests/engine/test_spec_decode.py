"""Speculative decoding (n-gram proposer and the embedded hidden-state drafter) on the embedded tiny K3 (fp32,
reference ops, CPU).

Greedy outputs are identical with and without speculation for 200 seeded prompts (repetitive ones that n-gram drafts,
ones sharing prefixes, random ones) for both methods, k in {1, 3, 7}, prefix caching on/off and preemption forced:
six of those 24 configurations cover every k and every cache mode, the other 18 are marked ``slow`` (the reference
ops cost ~8 s of CPU per 200-prompt run; ``-m "not slow"`` leaves them out); the cache invariants hold after every
step and no block, KDA state slot (running, per-position or pending) or draft bookkeeping is held at the end; the
acceptance rule preserves the target distribution (chi-square at p = 0.001) and a broken rule is caught; n-gram
drafts are accepted on a repetitive prompt; config errors name the bad key.
"""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch

from rocm_k3.args import EngineArgs
from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode import acceptance
from rocm_k3.spec_decode.acceptance import accept_drafts
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER, SpeculativeConfig
from rocm_k3.spec_decode.ngram import propose_ngram
from rocm_k3.worker.sampler import make_generator, sample
from tests.engine_fixtures import core_for, run_checked, varied_prompts
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)


@pytest.fixture(scope="module")
def model():
    return load_model(ensure_embedded_model(), dtype=torch.float32, progress=False)


def _engine(model, spec: SpeculativeConfig | None, *, caching: bool, tight: bool, wide: bool = False, **core_kw):
    """core_kw: passed to ``core_for`` (model_path / output_family for grammars). wide: 64 sequences a step (the
    200-prompt matrix; tight then leaves ~25 of them room, so preemptions happen), else 4."""
    seqs = 64 if wide else 4
    blocks = (100 if tight else 1024) if wide else (8 if tight else 48)
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, enable_prefix_caching=caching,
                        num_blocks=blocks, num_state_slots=10 * seqs)
    cfg = EngineConfig(max_num_batched_tokens=1024 if wide else 64, max_num_seqs=seqs, max_model_len=96, cache=cache,
                       speculative=spec)
    return core_for(model, cfg, **core_kw)


def _prompts(vocab: int, n: int = 10) -> list[list[int]]:
    """Half repetitive (n-gram drafts happen), half random; some share a prefix (prefix-cache hits)."""
    rng = random.Random(33)
    shared = [rng.randrange(vocab) for _ in range(24)]
    out = []
    for i in range(n):
        if i % 2 == 0:
            pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
            out.append((pattern * 12)[: rng.randint(12, 40)])
        else:
            out.append(shared[: rng.randint(17, 24)] + [rng.randrange(vocab) for _ in range(rng.randint(4, 20))])
    return out


METHODS = ("ngram", "draft_model")


def _spec(method: str, k: int) -> SpeculativeConfig:
    """k-token speculation by ``method`` (draft_model: the drafter shipped beside the embedded model)."""
    model = EMBEDDED_DRAFTER if method == "draft_model" else None
    return SpeculativeConfig(method=method, model=model, num_speculative_tokens=k)


def _run(engine, prompts, params) -> dict[str, list[int]]:
    """``params``: one SamplingParams for all prompts, or a list (one per prompt)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    return run_checked(engine)


GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MODES = ((True, False), (False, True), (True, True), (False, False))  # (prefix caching, preemption forced)
# (method, k) -> the cache mode of its default run: every k and every mode runs by default, the rest under -m slow
DEFAULT_MODE = {("ngram", 1): 0, ("ngram", 3): 1, ("ngram", 7): 2, ("draft_model", 1): 3, ("draft_model", 3): 0,
                ("draft_model", 7): 1}
MATRIX = [pytest.param(method, k, caching, tight, id=f"{method}-k{k}-{'prefix-cache' if caching else 'no-cache'}-"
                       f"{'preempting' if tight else 'roomy'}",
                       marks=() if MODES[DEFAULT_MODE[method, k]] == (caching, tight) else pytest.mark.slow)
          for method in METHODS for k in (1, 3, 7) for caching, tight in MODES]


@pytest.fixture(scope="module")
def many_greedy(model):
    """The 200 prompts and their greedy tokens without speculation (roomy, no prefix caching)."""
    prompts = varied_prompts(model.cfg.vocab_size, 200)
    return prompts, _run(_engine(model, None, caching=False, tight=False, wide=True), prompts, GREEDY_16)


@pytest.mark.parametrize("method, k, caching, tight", MATRIX)
def test_greedy_identical_with_speculation_on_200_prompts(model, many_greedy, method, k, caching, tight):
    prompts, base = many_greedy
    eng = _engine(model, _spec(method, k), caching=caching, tight=tight, wide=True)
    out = _run(eng, prompts, GREEDY_16)  # checks the invariants after every step, and that nothing is held after
    differ = [r for r in base if out[r] != base[r]]
    assert not differ, f"{len(differ)} of {len(base)} requests differ, e.g. {differ[:5]}"
    stats = eng.stats()
    # drafts were verified, and rolled back at several accepted lengths (some but not all drafts accepted)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    if k > 1:
        assert stats["spec_num_accepted_tokens_pos1"] > 0, stats  # some verifications accepted two drafts or more
    if tight:
        assert stats["preemptions"] >= 1, stats
    if caching:
        assert stats["hit_requests"] >= 20, stats


@pytest.mark.parametrize("method", METHODS)
def test_max_tokens_and_stop_tokens_never_overshoot(model, method):
    prompts = _prompts(model.cfg.vocab_size, 4)[::2]  # repetitive ones: long accepted runs
    base = _run(_engine(model, None, caching=True, tight=False), prompts,
                SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = _run(_engine(model, _spec(method, 7), caching=True, tight=False), prompts, params)
        assert out == {r: t[:max_tokens] for r, t in base.items()}
    stop = base["0"][6]  # a token that occurs mid-way in the first output
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    spec = _run(_engine(model, _spec(method, 7), caching=True, tight=False), prompts[:1], params)
    assert spec["0"] == base["0"][: base["0"].index(stop) + 1]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_with_speculation_is_reproducible(model, method):
    prompts = _prompts(model.cfg.vocab_size, 4)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01, max_tokens=12, seed=5, ignore_eos=True)
    runs = [_run(_engine(model, _spec(method, 3), caching=True, tight=False), prompts, params) for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == 12 for t in runs[0].values())


def _encode(text: str) -> list[int]:
    from rocm_k3.tokenizers.loader import load_tokenizer

    return load_tokenizer(ensure_embedded_model()).encode(text)


def test_ngram_accepts_more_than_one_and_a_half_tokens_per_step_on_a_repetitive_prompt(model):
    prompt = _encode("hello hello hello hello hello hello")
    eng = _engine(model, SpeculativeConfig(num_speculative_tokens=4), caching=True, tight=False)
    _run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stats = eng.stats()
    assert stats["spec_mean_accepted_length"] > 1.5, stats
    assert 0 < stats["spec_acceptance_rate"] <= 1
    assert stats["spec_acceptance_rate_pos0"] >= stats["spec_acceptance_rate_pos3"]


# ---- the acceptance rule preserves the target distribution ---------------------------------------------------
V = 6
P0 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # logits of the first token


def _p1(prev: int) -> torch.Tensor:
    """Logits of the second token given the first (a different distribution per first token)."""
    return torch.roll(torch.tensor([1.8, 1.2, 0.9, 0.4, 0.1, -0.5]), prev)


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution at temperature 1 / top-p (computed the long way, for the expected counts)."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[before < params.top_p]] = True
    probs = torch.where(keep, probs, torch.zeros(()))
    return probs / probs.sum()


def _two_tokens(seed: int, params: SamplingParams, drafts: tuple[int, int]) -> tuple[int, int]:
    """Two generated tokens with n-gram drafts ``drafts`` verified in one step (rows: first token, after
    draft 0, after both), then plain sampling for what the verification did not produce."""
    gen = make_generator(seed)
    rows = torch.stack([P0, _p1(drafts[0]), _p1(drafts[1])])  # the third row's distribution is never used here
    tokens = sample(rows, [params] * 3, [gen] * 3).token_ids.tolist()
    accepted, token = acceptance.accept_drafts(list(drafts), tokens)
    out = [*accepted, token]
    if len(out) < 2:
        out.append(int(sample(_p1(out[0])[None], [params], [gen]).token_ids[0]))
    return out[0], out[1]


def _chi_square_fails(observed: collections.Counter, expected: dict, n: int) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001) over cells with expected count >= 5 (the rest pooled)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + observed.get(cell, 0), pooled_exp + e
            continue
        stat += (observed.get(cell, 0) - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    outside = sum(c for cell, c in observed.items() if cell not in expected or expected[cell] == 0)
    if outside:
        stat = math.inf  # a token the target never produces
    df = cells - 1
    z = 3.090  # the standard normal's 0.999 quantile; Wilson-Hilferty for the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def _sampling_matches_target(n: int = 4000) -> bool:
    params = SamplingParams(temperature=1.0, top_p=0.9)
    drafts = (1, 3)  # a plausible first token, then an unlikely second one
    first, joint = collections.Counter(), collections.Counter()
    for seed in range(n):
        a, b = _two_tokens(seed, params, drafts)
        first[a] += 1
        joint[(a, b)] += 1
    p0 = _target_probs(P0, params)
    exp_first = {a: float(p0[a]) for a in range(V)}
    exp_joint = {(a, b): float(p0[a] * _target_probs(_p1(a), params)[b]) for a in range(V) for b in range(V)}
    s1, c1 = _chi_square_fails(first, exp_first, n)
    s2, c2 = _chi_square_fails(joint, exp_joint, n)
    return s1 < c1 and s2 < c2


def test_rejection_sampling_preserves_the_target_distribution():
    assert _sampling_matches_target()


def test_a_broken_acceptance_rule_is_detected(monkeypatch):
    def accept_if_plausible(drafts, sampled):  # broken: a draft is taken whenever it has any target mass
        return list(drafts), int(sampled[len(drafts)])

    monkeypatch.setattr(acceptance, "accept_drafts", accept_if_plausible)
    assert not _sampling_matches_target()


# ---- units -------------------------------------------------------------------------------------------------
def test_accept_drafts_longest_matching_prefix():
    assert accept_drafts([4, 5, 6], [4, 5, 9, 1]) == ([4, 5], 9)
    assert accept_drafts([4, 5], [4, 5, 7]) == ([4, 5], 7)  # all accepted: the bonus token
    assert accept_drafts([4], [3, 0]) == ([], 3)


def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 9, 1, 2], 3, 1, 3) == [3, 9, 1]  # the longest n-gram (1, 2) recurs
    assert propose_ngram([1, 2, 3, 4], 2, 1, 3) == []  # no recurrence
    assert propose_ngram([7, 8, 7, 5, 7], 2, 1, 1) == [5, 7]  # the most recent earlier match of (7,)
    assert propose_ngram([5, 5, 5], 4, 2, 2) == [5]  # what follows the match, up to the end


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle"}', "draft_model"),
    ('{"method": "dspark", "model": "x"}', "draft_model"),
    ('{"method": "draft_model"}', "needs the drafter"),
    ('{"method": "ngram", "model": "some/dir"}', "takes no draft model"),
    ('{"num_speculative_tokens": 9}', "at most 8"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"num_spec_tokens": 3}', "unknown keys"),
    ('{"disable_by_batch_size": 1}', "disable_by_batch_size"),
    ('{"disable_by_batch_size": "4"}', "disable_by_batch_size"),
    ("{not json", "not valid JSON"),
])
def test_speculative_config_errors_name_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value).validated()


def test_disable_by_batch_size_drafts_only_below_the_cut(model):
    """vLLM's ``disable_by_batch_size``: a step decoding at least that many sequences drafts nothing; below it
    speculation runs; the tokens are the greedy ones either way."""
    prompts = [_encode(t) for t in ("hello hello hello hello hello hello", "1 2 3 1 2 3 1 2 3 1 2 3")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = _run(_engine(model, None, caching=True, tight=False), prompts, params)
    cut = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    both = _engine(model, cut, caching=True, tight=False)
    assert _run(both, prompts, params) == base
    assert both.stats()["spec_num_draft_tokens"] == 0  # two decoding at once: never drafted
    alone = _engine(model, cut, caching=True, tight=False)
    assert _run(alone, prompts[:1], params) == {"0": base["0"]}
    assert alone.stats()["spec_num_draft_tokens"] > 0


def test_speculative_config_flag_and_kwarg():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    args = EngineArgs.from_cli(ns)
    assert SpeculativeConfig.parse(args.speculative_config) == SpeculativeConfig(num_speculative_tokens=5)
    assert SpeculativeConfig.parse({"prompt_lookup_max": 6}).prompt_lookup_max == 6


def test_logprobs_with_speculation_match_one_token_decoding(model):
    prompts = [_encode(t) for t in ("hello hello hello hello hello hello", "1 2 3 4 5 6 7 8 9 10 11 12")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = []
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3)):
        eng = _engine(model, spec, caching=True, tight=False)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        done = eng.run_to_completion()
        outputs.append((done, eng.stats()))
    (base, _), (spec, stats) = outputs
    assert stats["spec_num_accepted_tokens"] > 0
    for rid, out in base.items():
        assert spec[rid].token_ids == out.token_ids
        assert len(spec[rid].logprobs) == len(out.logprobs) == 12
        for want, got in zip(out.logprobs, spec[rid].logprobs):
            assert list(got) == list(want)  # chosen token first, then the same top alternatives
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
