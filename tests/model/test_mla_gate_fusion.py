"""The MLA output gate fused into the prefill op (``ops.mla_prefill(gate=...)``) against the separate gate.

The model passes the gate logits to ``ops.mla_prefill`` at prefill (the kernel's epilogue multiplies the fp32
output by ``sigmoid(gate)`` before its one rounding); the unfused path, which the model ran before, rounds the
attention output to the activation dtype and then multiplies by ``sigmoid(gate)`` in that dtype. The test swaps
``ops.mla_prefill`` for that unfused composition and compares the logits of every position of a chunked prefill
(sequence 0 continues an earlier chunk, sequence 1 is new), two sequences in one batch:

- CPU, reference backend, fp32: the two orders of the same fp32 operations: relative error <= 1e-6 (measured 0);
- bf16: the fused path skips one bf16 rounding per output element, which the random tiny model amplifies through
  its layers (measured 1.7e-2 on the CPU reference): <= 3e-2 relative, and the fused logits no further from the
  fp32 model's (same backend) than 1.25x the unfused ones' distance (the fusion must not lose accuracy);
- cuda tier, Triton backend, bf16, prompts of 160 + 40 tokens: the 160-token chunk takes the expanded flash
  kernel (gate in its epilogue, >= EXPANDED_MIN_QUERIES = 128 queries), the 40-token one the absorbed kernel
  (gate on its fp32 W_uv product): the bf16 bounds above.
Every case also checks that the gate was handed to the op, and that the gate matters (an ungated run is far off).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err, seeded
from model_fixtures import one_thread  # noqa: F401 (autouse)

from rocm_k3 import ops
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from simple_cache import SimpleCache


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("k3-gate"), seed=5)


def _chunked_logits(model, first: list[int], rest: list[int], other: list[int], device: str) -> torch.Tensor:
    """Prefill ``first`` of sequence 0, then ``rest`` of sequence 0 and ``other`` (sequence 1) in one batch: the
    logits of every position of that second step [len(rest) + len(other), vocab]."""
    cache = SimpleCache(model.cfg, max_seqs=2, max_model_len=len(first) + len(rest) + len(other), dtype=model.dtype,
                        device=device)
    model.forward(cache.prepare([(0, first)]), cache)
    batch = cache.prepare([(0, rest), (1, other)])
    batch.logits_indices = torch.arange(batch.num_tokens, device=device)
    return model.forward(batch, cache).float()


def _unfused(real, seen: list[bool], drop: bool = False):
    """``ops.mla_prefill`` with the gate applied after the op, in the gate's dtype (the model's former path);
    ``drop`` ignores the gate (the ungated control)."""

    def run(*args, gate=None, **kwargs):
        seen.append(gate is not None)
        out = real(*args, **kwargs)
        if gate is None or drop:
            return out
        return out.to(gate.dtype) * torch.sigmoid(gate)

    return run


def _compare(path, backend: str, dtype: torch.dtype, device: str, lens: tuple[int, int, int], tol: float,
             monkeypatch: pytest.MonkeyPatch) -> None:
    gen = seeded(7)
    first, rest, other = (torch.randint(1, 200, (n,), generator=gen).tolist() for n in lens)
    model = load_model(path, dtype=dtype, device=device, backend=backend, progress=False)
    assert model.cfg.mla_use_output_gate, "the tiny K3 must have the MLA output gate"
    real = ops.mla_prefill
    fused_calls: list[bool] = []

    def counted(*args, **kwargs):
        fused_calls.append("gate" in kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "mla_prefill", counted)
    fused = _chunked_logits(model, first, rest, other, device)
    assert fused_calls and all(fused_calls), f"the model did not pass the gate to mla_prefill: {fused_calls}"
    seen: list[bool] = []
    monkeypatch.setattr(ops, "mla_prefill", _unfused(real, seen))
    unfused = _chunked_logits(model, first, rest, other, device)
    assert seen and all(seen)
    assert torch.isfinite(fused).all() and torch.isfinite(unfused).all()
    err = rel_err(fused, unfused)
    assert err <= tol, f"fused vs separate gate: relative error {err:.3g} > {tol}"
    monkeypatch.setattr(ops, "mla_prefill", _unfused(real, [], drop=True))
    ungated = _chunked_logits(model, first, rest, other, device)
    assert rel_err(ungated, unfused) > 10 * tol, "the output gate does not change the logits: the test is blind"
    if dtype != torch.float32:
        monkeypatch.setattr(ops, "mla_prefill", real)
        truth = _chunked_logits(load_model(path, dtype=torch.float32, device=device, backend=backend, progress=False),
                                first, rest, other, device)
        assert rel_err(fused, truth) <= 1.25 * rel_err(unfused, truth), (rel_err(fused, truth),
                                                                          rel_err(unfused, truth))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_gate_fusion_reference_cpu(k3_dir, dtype: torch.dtype, tol: float, monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(k3_dir, "reference", dtype, "cpu", (24, 9, 15), tol, monkeypatch)


@pytest.mark.cuda
def test_gate_fusion_triton_cuda(k3_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from rocm_k3.triton_kernels.mla_prefill_expanded import EXPANDED_MIN_QUERIES

    assert 160 >= EXPANDED_MIN_QUERIES > 40  # one chunk per kernel
    _compare(k3_dir, "triton", torch.bfloat16, "cuda", (64, 160, 40), 3e-2, monkeypatch)
