"""``ops.prepare_expert_weights``: the load-time hook that re-lays routed experts for the serving backend."""

from __future__ import annotations

import pytest
import torch

from rocm_k3 import ops
from rocm_k3.ops.registry import BackendError
from rocm_k3.quant import quantize_mxfp4


def _experts() -> ops.ExpertWeights:
    g = torch.Generator().manual_seed(0)
    w13, s13 = quantize_mxfp4(torch.randn(4, 64, 64, generator=g))  # E=4, 2N=64, K=64
    w2, s2 = quantize_mxfp4(torch.randn(4, 64, 32, generator=g))  # Kout=64, N=32
    return ops.ExpertWeights("mxfp4", w13, s13, w2, s2)


def test_cpu_auto_keeps_checkpoint_layout_and_still_runs() -> None:
    weights = _experts()
    prepared = ops.prepare_expert_weights(weights)
    assert prepared.layout == "checkpoint"
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    wts = torch.full((3, 2), 0.5)
    out = ops.fused_moe(x, prepared, wts, ids, backend="reference")
    ref = ops.fused_moe(x, weights, wts, ids, backend="reference")
    assert torch.equal(out, ref)


def test_named_backend_that_cannot_serve_this_device_says_why() -> None:
    with pytest.raises(BackendError, match="flydsl.*cannot prepare weights"):
        ops.prepare_expert_weights(_experts(), backend="flydsl")


def test_unknown_backend_and_wrong_type_are_named() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        ops.prepare_expert_weights(_experts(), backend="cuda-magic")
    with pytest.raises(TypeError, match="ExpertWeights"):
        ops.prepare_expert_weights(torch.zeros(3))


def test_auto_passes_over_a_backend_whose_hook_rejects_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook's ValueError (weights its kernels cannot take) moves auto mode to the next backend; a named
    backend reports it as a BackendError."""
    import importlib

    from rocm_k3.ops import registry

    def reject(weights):
        raise ValueError("the FlyDSL MoE kernels take MXFP4 experts, got fmt='bf16'")

    def tag(weights):
        weights.extras["seen_by"] = "triton"
        return weights

    fly, tri = (importlib.import_module(registry.BACKEND_MODULES[n]) for n in ("flydsl", "triton"))
    monkeypatch.setattr(fly, "prepare_weights", reject)
    monkeypatch.setattr(tri, "prepare_weights", tag)
    monkeypatch.setattr(registry, "backend_available", lambda name, dev: (True, "test"))
    monkeypatch.setitem(registry.PRIORITY, "cpu", ("flydsl", "triton", "reference"))
    assert ops.prepare_expert_weights(_experts()).extras["seen_by"] == "triton"
    with pytest.raises(BackendError, match="flydsl.*cannot prepare these weights.*MXFP4"):
        ops.prepare_expert_weights(_experts(), backend="flydsl")
