"""The tiny K3 model (``rocm_k3.LLM(None)``) on the Triton backend against the reference backend.

- ``interpret`` tier (CPU): fp32 model, every op through the Triton kernels under ``TRITON_INTERPRET=1`` (the
  backend's ``available`` is patched: it refuses the CPU for real use); 4 greedy tokens must be identical and the
  chosen tokens' log-probabilities within 0.05 nats (measured 0.023: the MoE kernel rounds its MMA operands to bf16,
  the reference does not).
- ``cuda`` tier (H200): bf16 model, 32 greedy tokens identical, log-probabilities within 0.1 nats (bf16 operands on
  both sides, rounded at different points).
Triton reads TRITON_INTERPRET at its import; see tests/test_triton_ops.py for the subprocess fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import

triton = pytest.importorskip("triton")

from rocm_k3 import LLM, SamplingParams  # noqa: E402
from rocm_k3.triton_kernels import backend as triton_backend  # noqa: E402
from rocm_k3.triton_kernels.norm import _rms_norm_kernel  # noqa: E402
from rocm_k3.triton_kernels.runtime import interpreted  # noqa: E402

# both ours and Triton's own standard library must be interpreted (see tests/test_triton_ops.py)
_INTERPRETED = interpreted(_rms_norm_kernel) and interpreted(triton.language.sigmoid)
PROMPTS = ["Hello, my name is", "The capital of France"]


def _greedy(backend: str, dtype: str, device: str, steps: int, prompts: list[str]):
    llm = LLM(None, dtype=dtype, backend=backend, device=device)
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0))


def _compare(ref, tri, tol: float) -> None:
    for r, t in zip(ref, tri):
        assert t.token_ids == r.token_ids, f"greedy tokens differ:\nreference {r.token_ids}\ntriton    {t.token_ids}"
        ref_lp = torch.tensor([next(iter(step.values())) for step in r.logprobs])
        tri_lp = torch.tensor([next(iter(step.values())) for step in t.logprobs])
        assert torch.isfinite(tri_lp).all()
        err = (ref_lp - tri_lp).abs().max().item()
        assert err <= tol, f"chosen-token log-probabilities differ by {err:.3e} > {tol}"


@pytest.mark.interpret
@pytest.mark.skipif(not _INTERPRETED, reason="kernels are compiled in this process; see the subprocess test")
def test_tiny_model_triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _greedy("reference", "float32", "cpu", 4, PROMPTS[:1])
    monkeypatch.setattr(triton_backend, "available", lambda dev: (True, "interpreter test"))
    tri = _greedy("triton", "float32", "cpu", 4, PROMPTS[:1])
    _compare(ref, tri, 0.05)


@pytest.mark.interpret
@pytest.mark.skipif(_INTERPRETED or torch.cuda.is_available(),
                    reason="the interpreter tier ran in this process (or a GPU is present)")
def test_tiny_model_interpret_in_subprocess() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-m", "interpret", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.cuda
def test_tiny_model_triton_matches_reference_cuda() -> None:
    _compare(_greedy("reference", "bfloat16", "cuda", 32, PROMPTS), _greedy("triton", "bfloat16", "cuda", 32, PROMPTS),
             0.1)
