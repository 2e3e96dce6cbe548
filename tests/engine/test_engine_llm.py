"""rocm_k3.LLM on the engine: the engine keyword arguments, llm.stats(), prefix reuse across generate calls
with unchanged outputs, batched generate equal to one prompt at a time, and named errors for bad knobs."""

from __future__ import annotations

import pytest
import torch

import rocm_k3
from rocm_k3.cache.errors import AlignmentError, CacheBudgetError, MatchUnitError, TokenBudgetError
from rocm_k3.model.tiny import write_tiny_checkpoint
from tests.helpers import seeded
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

GREEDY = rocm_k3.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llm_engine"), seed=2)


def _llm(tiny_dir, caching: bool, **kwargs):
    knobs = {
        "block_size": 128,
        "match_unit": 64,
        "alignment": 128,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 4,
        "max_model_len": 512,
    }
    knobs.update(kwargs)
    return rocm_k3.LLM(tiny_dir, dtype="float32", enable_prefix_caching=caching, **knobs)


def test_prefix_reused_across_generate_calls_with_same_outputs(tiny_dir):
    vocab = 256
    system = torch.randint(1, vocab, (300,), generator=seeded(0)).tolist()
    questions = [torch.randint(1, vocab, (n,), generator=seeded(n)).tolist() for n in (5, 9, 17)]
    prompts = [system + q for q in questions]
    on, off = _llm(tiny_dir, True), _llm(tiny_dir, False)
    first = on.generate(prompts[0], GREEDY)
    rest = on.generate(prompts[1:], GREEDY)  # both find the system prompt's state saved by the first call
    stats = on.stats()
    assert stats["hit_requests"] == 2 and stats["hit_tokens"] == 2 * 256, stats  # 256 = last aligned point <= 300
    assert stats["queries"] == 3 and stats["saved_states"] >= 2 and 0 < stats["hit_rate"] < 1
    expected = off.generate(prompts, GREEDY)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in expected]
    assert off.stats()["queries"] == 0 and off.stats()["hit_tokens"] == 0
    # a batch gives what each prompt gives alone
    alone = [off.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert alone == [o.token_ids for o in expected]


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"block_size": 100}, MatchUnitError),
        ({"alignment": 96}, AlignmentError),
        ({"max_num_batched_tokens": 64}, TokenBudgetError),
        ({"kv_cache_bytes": 1000}, CacheBudgetError),
        ({"state_cache_bytes": 1000}, CacheBudgetError),
    ],
    ids=["block-not-multiple-of-unit", "alignment-not-multiple-of-unit", "token-budget", "kv-budget", "state-budget"],
)
def test_bad_engine_knobs_raise_named_errors(tiny_dir, kwargs, error):
    with pytest.raises(error):
        _llm(tiny_dir, True, **kwargs)
