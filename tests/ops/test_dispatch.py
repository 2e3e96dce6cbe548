"""Op registry and dispatch: backend choice, named errors with reasons, fallback logging, `rocm-k3 ops`."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from rocm_k3 import cli
from rocm_k3.ops import norm, registry
from rocm_k3.ops.devices import device_info
from rocm_k3.settings import override

# every op of /work/contract.md, written out here rather than read from the package
CONTRACT_OPS = (
    "quantize_mxfp4", "dequantize_mxfp4", "quantize_mxfp8", "dequantize_mxfp8",
    "rms_norm", "add_rms_norm",
    "situ_and_mul", "silu_and_mul", "route", "fused_moe",
    "kda_gate", "short_conv", "short_conv_update", "kda_prefill", "kda_decode", "gated_rms_norm",
    "attn_res_mix", "attn_res_step",
    "mla_write_cache", "mla_prefill", "mla_decode",
)  # fmt: skip


@pytest.fixture
def isolated_registry(monkeypatch):
    """Private copies of the registry tables, so fake ops and backends vanish after the test."""
    monkeypatch.setattr(registry, "_impls", {op: dict(b) for op, b in registry._impls.items()})
    monkeypatch.setattr(registry, "_ops", list(registry._ops))
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))
    monkeypatch.setattr(registry, "_logged", set())
    return registry


def norm_args():
    return torch.randn(3, 32), torch.ones(32)


def test_unknown_backend_is_a_value_error():
    x, w = norm_args()
    with pytest.raises(ValueError, match="unknown backend 'cuda-magic'"):
        norm.rms_norm(x, w, backend="cuda-magic")
    with pytest.raises(ValueError, match="unknown backend"):
        registry.register("rms_norm", "cuda-magic", lambda *a: None)


@pytest.mark.parametrize("backend, reason", [("flydsl", "flydsl"), ("aiter", "ROCm")])
def test_named_backend_that_cannot_run_raises_backend_error_with_reason(backend, reason):
    x, w = norm_args()
    with pytest.raises(registry.BackendError, match=f"backend '{backend}' cannot run rms_norm on CPU") as info:
        norm.rms_norm(x, w, backend=backend)
    message = str(info.value)
    assert reason in message
    assert message.split("on CPU: ", 1)[1].strip(), f"no reason in {message!r}"


def test_auto_on_cpu_resolves_to_reference_and_settings_can_name_a_backend():
    x, w = norm_args()
    with override(backend="auto"):
        assert registry.resolve("rms_norm", None, (x, w, 1e-5), {}).backend == "reference"
        assert torch.equal(norm.rms_norm(x, w), norm.rms_norm(x, w, backend="reference"))
    with override(backend="aiter"):
        with pytest.raises(registry.BackendError, match="aiter"):
            norm.rms_norm(x, w)
        assert norm.rms_norm(x, w, backend="reference").shape == x.shape  # the argument beats the setting


def test_supports_rejection_carries_the_reason(isolated_registry):
    isolated_registry.register(
        "probe_op", "reference", lambda t: t + 1, supports=lambda t: (t.numel() % 2 == 0, "needs an even size")
    )
    assert isolated_registry.dispatch("probe_op", "reference", torch.zeros(4)).tolist() == [1.0] * 4
    with pytest.raises(registry.BackendError, match="needs an even size"):
        isolated_registry.dispatch("probe_op", "reference", torch.zeros(3))
    with override(backend="auto"):
        with pytest.raises(
            registry.BackendError, match="no backend can run probe_op on CPU: reference: needs an even size"
        ):
            isolated_registry.dispatch("probe_op", None, torch.zeros(3))


def test_backend_failing_at_import_is_reported_unavailable(isolated_registry, monkeypatch):
    broken = types.ModuleType("rocm_k3_test_broken_backend")

    def register() -> None:
        raise RuntimeError("HIP runtime not found")

    broken.register = register
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    monkeypatch.setitem(isolated_registry.BACKEND_MODULES, "flydsl", broken.__name__)
    isolated_registry._loaded.pop("flydsl", None)
    ok, reason = isolated_registry.backend_available("flydsl", device_info("cpu"))
    assert not ok and "RuntimeError: HIP runtime not found" in reason
    x, w = norm_args()
    with pytest.raises(registry.BackendError, match="HIP runtime not found"):
        norm.rms_norm(x, w, backend="flydsl")


def test_automatic_fallback_is_logged_once(isolated_registry, monkeypatch, caplog):
    monkeypatch.setitem(isolated_registry.PRIORITY, "cpu", ("aiter", "reference"))
    x, w = norm_args()
    with override(backend="auto"), caplog.at_level(logging.INFO, logger="rocm_k3.ops"):
        norm.rms_norm(x, w)
        norm.rms_norm(x, w)
    messages = [r.getMessage() for r in caplog.records if r.name == "rocm_k3.ops"]
    assert len(messages) == 1, messages
    assert messages[0].startswith("rms_norm: using reference backend (aiter: aiter needs a ROCm GPU")


def test_ops_cli_lists_every_contract_op_on_reference(capsys):
    with override(backend="auto"):
        code = cli.main(["ops", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    resolved = {}
    for line in out.splitlines():
        if "  -> " in line:
            op, chosen = line.split("  -> ")
            resolved[op.strip()] = chosen.strip()
    missing = [op for op in CONTRACT_OPS if op not in resolved]
    assert not missing, f"ops missing from `rocm-k3 ops`: {missing}\n{out}"
    assert {op: resolved[op] for op in CONTRACT_OPS} == {op: "reference" for op in CONTRACT_OPS}


def test_ops_cli_explains_why_gpu_backends_are_not_used_on_cpu(capsys):
    with override(backend="auto"):
        cli.main(["ops", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "flydsl: not used: flydsl kernels need an AMD gfx942/gfx950 GPU" in out
    assert "triton: not used: triton needs a GPU" in out
