"""Asynchronous scheduling on the GPU (cuda tier). Apart from tests/engine/test_async_scheduling.py so that it
imports nothing the H200 image lacks (pydantic, the server's stack)."""

from __future__ import annotations

import pytest
import torch

import rocm_k3
from rocm_k3.sampling_params import SamplingParams


@pytest.mark.cuda
def test_decode_graphs_with_async_scheduling_give_the_tokens_of_one_step_at_a_time() -> None:
    """On the GPU the placeholder decodes replay a decode graph (their tokens written into its input buffer after
    the fill); greedy fp32 tokens equal those of one step at a time, with graphs replayed."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[5, 6, 7, 8], list(range(30, 70)), [9] * 17]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for flag in (False, True):
        llm = rocm_k3.LLM(dtype="float32", backend="triton", device="cuda", max_num_seqs=8, max_model_len=1024,
                          kv_cache_bytes=1 << 30, state_cache_bytes=1 << 30, async_scheduling=flag)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.executor.worker.runner.graphs.replays > 0
        assert llm.engine.stats()["steps_in_flight_max"] == (2 if flag else 0)
        llm.shutdown()
    assert outs[1] == outs[0]
