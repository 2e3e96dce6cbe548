"""The MLA output gate fused into the prefill op (``ops.mla_prefill(gate=...)``) against the separate gate.

The model passes the gate logits to ``ops.mla_prefill`` at prefill (the kernel's epilogue multiplies the fp32
output by ``sigmoid(gate)`` before its one rounding); the unfused path, which the model ran before, rounds the
attention output to the activation dtype and then multiplies by ``sigmoid(gate)`` in that dtype. The test swaps
``ops.mla_prefill`` for that unfused composition and runs a chunked prefill (sequence 0 continues an earlier chunk,
sequence 1 is new, one batch) both ways:

- fp32 (CPU, reference backend): the two orders of the same fp32 operations: the logits of every position within
  1e-6 relative (measured 0);
- bf16: the fused path skips one bf16 rounding per attention output element. Compared: the output of the model's
  first MLA layer (its input is the same both ways), within 1e-2 relative (measured 4.0e-3 on the CPU reference:
  about one bf16 rounding). The logits are not compared in bf16: the random tiny model amplifies one-ulp changes
  through MoE routing flips (measured 1.7e-2 between the two on the CPU reference), so a logits bound would test
  the model, not the fusion;
- cuda tier (Triton backend, bf16): prompts of 160 + 40 new tokens, so the 160-token chunk takes the expanded
  flash kernel (gate in its epilogue, >= EXPANDED_MIN_QUERIES = 128 queries) and the 40-token one the absorbed
  kernel (gate on its fp32 W_uv product); the bf16 bound above. (A first version compared bf16 logits and failed
  on the H200, 2026-12-04; which bound it missed was not captured.)
Every case checks that the gate reached the op, and that the gate matters (without it the output is far off).
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


def _chunked_step(model, first: list[int], rest: list[int], other: list[int], device: str):
    """Prefill ``first`` of sequence 0, then ``rest`` of sequence 0 and ``other`` (sequence 1) in one batch: that
    second step's logits [len(rest) + len(other), vocab] and its first MLA layer's output [same, hidden]."""
    from rocm_k3.model.mla import MLALayer

    cache = SimpleCache(model.cfg, max_seqs=2, max_model_len=len(first) + len(rest) + len(other), dtype=model.dtype,
                        device=device)
    model.forward(cache.prepare([(0, first)]), cache)
    layer = next(m for m in model.modules() if isinstance(m, MLALayer))
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda mod, args, out: seen.append(out.detach().float()))
    try:
        batch = cache.prepare([(0, rest), (1, other)])
        batch.logits_indices = torch.arange(batch.num_tokens, device=device)
        logits = model.forward(batch, cache).float()
    finally:
        handle.remove()
    return logits, seen[0]


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
    fused = _chunked_step(model, first, rest, other, device)
    assert fused_calls and all(fused_calls), f"the model did not pass the gate to mla_prefill: {fused_calls}"
    seen: list[bool] = []
    monkeypatch.setattr(ops, "mla_prefill", _unfused(real, seen))
    unfused = _chunked_step(model, first, rest, other, device)
    assert seen and all(seen)
    monkeypatch.setattr(ops, "mla_prefill", _unfused(real, [], drop=True))
    ungated = _chunked_step(model, first, rest, other, device)
    which = 0 if dtype == torch.float32 else 1  # fp32: the logits; bf16: the first MLA layer's output
    for t in (*fused, *unfused):
        assert torch.isfinite(t).all()
    err = rel_err(fused[which], unfused[which])
    assert err <= tol, f"fused vs separate gate ({['logits', 'MLA output'][which]}): relative error {err:.3g} > {tol}"
    assert rel_err(ungated[1], unfused[1]) > 10 * tol, "the output gate does not change the MLA output: blind test"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_gate_fusion_reference_cpu(k3_dir, dtype: torch.dtype, tol: float, monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(k3_dir, "reference", dtype, "cpu", (24, 9, 15), tol, monkeypatch)


@pytest.mark.cuda
def test_gate_fusion_triton_cuda(k3_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from rocm_k3.triton_kernels.mla_prefill_expanded import EXPANDED_MIN_QUERIES

    assert 160 >= EXPANDED_MIN_QUERIES > 40  # one chunk per kernel
    _compare(k3_dir, "triton", torch.bfloat16, "cuda", (64, 160, 40), 1e-2, monkeypatch)
