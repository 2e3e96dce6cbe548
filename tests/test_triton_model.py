"""The tiny K3 model on the Triton backend against the reference backend (cuda tier, H200).

Greedy decoding must give identical tokens for 32 steps, and the chosen tokens' log-probabilities must agree
within 2e-2 (absolute, in nats: bf16 activations through a few dozen kernels on each side).
"""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["Hello, my name is", "The capital of France"]
STEPS = 32


def _run(backend: str):
    from rocm_k3 import LLM, SamplingParams

    llm = LLM(None, dtype="bfloat16", backend=backend, device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    return llm.generate(PROMPTS, params)


@pytest.mark.cuda
def test_tiny_model_triton_matches_reference_greedy() -> None:
    ref = _run("reference")
    tri = _run("triton")
    for r, t in zip(ref, tri):
        assert t.token_ids == r.token_ids, f"greedy tokens differ:\nreference {r.token_ids}\ntriton    {t.token_ids}"
        ref_lp = torch.tensor([next(iter(step.values())) for step in r.logprobs])
        tri_lp = torch.tensor([next(iter(step.values())) for step in t.logprobs])
        assert torch.isfinite(tri_lp).all()
        assert (ref_lp - tri_lp).abs().max().item() <= 2e-2
