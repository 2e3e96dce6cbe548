"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) through the step contract: each prompt token's
log-probability given the tokens before it equals what generating from that shorter prompt reports for it, with
chunked prefill; such a request reads no cached prefix (every position is computed) but still fills the cache."""

from __future__ import annotations

import math

import pytest
import torch

import rocm_k3
from rocm_k3.model.tiny import write_tiny_checkpoint
from tests.helpers import seeded
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_prompt_logprobs"), seed=3)
    return rocm_k3.LLM(path, dtype="float32", block_size=128, match_unit=64, alignment=128,
                       max_num_batched_tokens=132, max_num_seqs=4, max_model_len=512)


def test_prompt_logprobs_match_generation_over_chunks_and_skip_the_cache(llm) -> None:
    prompt = torch.randint(1, 256, (300,), generator=seeded(7)).tolist()  # 3 prefill chunks of <= 128
    asked = rocm_k3.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    out = llm.generate(prompt, asked)[0]
    lps, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert len(lps) == len(ranks) == len(prompt) and lps[0] is None and ranks[0] is None
    for k in range(1, len(prompt)):
        entry = lps[k]
        assert next(iter(entry)) == prompt[k] and len(entry) <= 4  # the prompt token first, then the top 3
        best = max(entry.values())
        assert ranks[k] >= 1 and (ranks[k] == 1) == (entry[prompt[k]] >= best)
        assert all(v <= 0 for v in entry.values())
    every = rocm_k3.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1 << 20)  # every token
    for k in (1, 127, 128, 129, 255, 256, 299):  # chunk edges included
        alone = llm.generate(prompt[:k], every)[0].logprobs[0]
        assert math.isclose(alone[prompt[k]], lps[k][prompt[k]], abs_tol=2e-4), k
    # the same prompt again: computed again (nothing read from the cache), the same numbers
    again = llm.generate(prompt, asked)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == out.token_ids
    assert all(a is None or math.isclose(a[t], b[t], abs_tol=1e-5)
               for a, b, t in zip(again.prompt_logprobs, lps, prompt))
    # ... while a plain request finds the prefix the prompt-logprobs requests saved
    plain = llm.generate(prompt, rocm_k3.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert plain.num_cached_tokens == 256 and plain.token_ids == out.token_ids and plain.prompt_logprobs is None


def test_prompt_logprobs_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs: expected an int in \\[0, inf\\) or None"):
        rocm_k3.SamplingParams(prompt_logprobs=-1)
