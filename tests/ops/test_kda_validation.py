"""Named boundary errors of the KDA public ops: every bad argument raises ValueError/TypeError naming it.

Each case starts from a valid call (checked to pass first) and breaks one argument.
"""

from __future__ import annotations

import pytest
import torch

from rocm_k3.ops import kda
from rocm_k3.ops.kda import KDAGateParams

T, H, K, V, S, N, W = 10, 2, 8, 8, 4, 2, 4
i32 = torch.int32


def _prefill_args() -> dict:
    return {
        "q": torch.randn(T, H, K), "k": torch.randn(T, H, K), "v": torch.randn(T, H, V), "g": -torch.rand(T, H, K),
        "beta": torch.randn(T, H), "cu_seqlens": torch.tensor([0, 4, T], dtype=i32), "state": torch.zeros(S, H, K, V),
        "state_indices": torch.tensor([2, 0], dtype=i32), "has_initial_state": torch.tensor([True, False]),
    }


def _run_prefill(overrides: dict, **kwargs):
    args = _prefill_args()
    args.update(overrides)
    return kda.kda_prefill(**args, **kwargs, backend="reference")


def test_valid_prefill_call_passes():
    out = _run_prefill({}, intermediate_positions=torch.tensor([[0, 4], [1, 1]], dtype=i32))
    assert out.o.shape == (T, H, V) and out.intermediate_states.shape == (2, H, K, V)


PREFILL_ERRORS = [
    ("q-rank", {"q": torch.randn(T, H * K)}, {}, ValueError, "q must be 3-D"),
    ("k-shape", {"k": torch.randn(T, H, K + 1)}, {}, ValueError, "k must have shape [T, H, K]"),
    ("v-tokens", {"v": torch.randn(T + 1, H, V)}, {}, ValueError, "v must have shape [T, H, V]"),
    ("g-shape", {"g": torch.randn(T, H, K - 1)}, {}, ValueError, "g must have shape"),
    ("beta-shape", {"beta": torch.randn(T, H, 1)}, {}, ValueError, "beta must be 2-D"),
    ("q-int", {"q": torch.ones(T, H, K, dtype=torch.int64)}, {}, TypeError, "q must be bfloat16 or float16 or float32"),
    ("qkv-mixed", {"k": torch.randn(T, H, K).bfloat16()}, {}, TypeError, "q, k, v must share one dtype"),
    ("g-bf16-logdecay", {"g": torch.randn(T, H, K).bfloat16()}, {}, TypeError, "g (the log-decay"),
    ("state-bf16", {"state": torch.zeros(S, H, K, V).bfloat16()}, {}, TypeError, "state must be float32"),
    ("state-shape", {"state": torch.zeros(S, H, V, K + 1)}, {}, ValueError, "state must have shape [S, H, K, V]"),
    ("cu-int64", {"cu_seqlens": torch.tensor([0, 4, T])}, {}, TypeError, "cu_seqlens must be int32"),
    ("cu-start", {"cu_seqlens": torch.tensor([1, 4, T], dtype=i32)}, {}, ValueError, "cu_seqlens must start at 0"),
    ("cu-decreasing", {"cu_seqlens": torch.tensor([0, 7, 5, T], dtype=i32),
                       "state_indices": torch.tensor([0, 1, 2], dtype=i32),
                       "has_initial_state": torch.tensor([True, True, True])}, {}, ValueError, "nondecreasing"),
    ("cu-last", {"cu_seqlens": torch.tensor([0, 4, T - 1], dtype=i32)}, {}, ValueError, "cu_seqlens[-1] must equal"),
    ("cu-too-short", {"cu_seqlens": torch.tensor([0], dtype=i32)}, {}, ValueError, "N+1 >= 2"),
    ("slots-range", {"state_indices": torch.tensor([2, S], dtype=i32)}, {}, ValueError, "state_indices must lie in"),
    ("slots-negative", {"state_indices": torch.tensor([-1, 0], dtype=i32)}, {}, ValueError, "must lie in [0, 4)"),
    ("slots-duplicate", {"state_indices": torch.tensor([1, 1], dtype=i32)}, {}, ValueError, "duplicates [1]"),
    ("slots-count", {"state_indices": torch.tensor([1], dtype=i32)}, {}, ValueError, "state_indices must have shape"),
    ("slots-int64", {"state_indices": torch.tensor([1, 0])}, {}, TypeError, "state_indices must be int32"),
    ("has-init-int", {"has_initial_state": torch.tensor([1, 0], dtype=i32)}, {}, TypeError,
     "has_initial_state must be bool"),
    ("pos-shape", {}, {"intermediate_positions": torch.tensor([1, 2], dtype=i32)}, ValueError, "[M, 2]"),
    ("pos-int64", {}, {"intermediate_positions": torch.tensor([[0, 1]])}, TypeError,
     "intermediate_positions must be int32"),
    ("pos-seq", {}, {"intermediate_positions": torch.tensor([[2, 1]], dtype=i32)}, ValueError, "names sequence 2"),
    ("pos-zero", {}, {"intermediate_positions": torch.tensor([[0, 0]], dtype=i32)}, ValueError, "p must be in [1, 4]"),
    ("pos-past-end", {}, {"intermediate_positions": torch.tensor([[1, 7]], dtype=i32)}, ValueError,
     "p must be in [1, 6]"),
    ("scale-neg", {}, {"scale": -1.0}, ValueError, "scale must be > 0"),
    ("flag-type", {}, {"qk_l2norm": 1}, TypeError, "qk_l2norm must be a bool"),
    ("gate-params-tuple", {"g": torch.randn(T, H, K)},
     {"gate_params": (torch.zeros(H), torch.zeros(H * K), -5.0)}, TypeError, "gate_params must be a KDAGateParams"),
    ("gate-A_log-shape", {"g": torch.randn(T, H, K)},
     {"gate_params": KDAGateParams(torch.zeros(H + 1), torch.zeros(H * K), -5.0)}, ValueError, "A_log must have"),
    ("gate-dt_bias-bf16", {"g": torch.randn(T, H, K)},
     {"gate_params": KDAGateParams(torch.zeros(H), torch.zeros(H * K).bfloat16(), -5.0)}, TypeError,
     "dt_bias must be float32"),
    ("gate-positive-bound", {"g": torch.randn(T, H, K)},
     {"gate_params": KDAGateParams(torch.zeros(H), torch.zeros(H * K), 5.0)}, ValueError, "lower_bound must be < 0"),
    ("q-not-tensor", {"q": [[0.0]]}, {}, TypeError, "q must be a torch.Tensor"),
]


@pytest.mark.parametrize("overrides,kwargs,exc,fragment", [c[1:] for c in PREFILL_ERRORS],
                         ids=[c[0] for c in PREFILL_ERRORS])
def test_prefill_errors(overrides, kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        _run_prefill(overrides, **kwargs)
    assert fragment in str(info.value)
    assert str(info.value).startswith("kda_prefill: ")


def test_prefill_does_not_touch_state_on_error():
    args = _prefill_args()
    args["state"] = torch.randn(S, H, K, V)
    before = args["state"].clone()
    args["state_indices"] = torch.tensor([3, 3], dtype=i32)
    with pytest.raises(ValueError):
        kda.kda_prefill(**args, backend="reference")
    assert torch.equal(args["state"], before)


def _conv_args() -> dict:
    return {
        "x": torch.randn(T, 6), "weight": torch.randn(6, W), "cu_seqlens": torch.tensor([0, 3, T], dtype=i32),
        "conv_state": torch.zeros(S, 6, W - 1), "state_indices": torch.tensor([1, 3], dtype=i32),
        "has_initial_state": torch.tensor([False, True]),
    }


CONV_ERRORS = [
    ("ok", {}, None, ""),
    ("x-rank", {"x": torch.randn(T, 2, 3)}, ValueError, "x must be 2-D [T, C]"),
    ("weight-channels", {"weight": torch.randn(5, W)}, ValueError, "weight must have shape [C, W] = [6, 4]"),
    ("state-width", {"conv_state": torch.zeros(S, 6, W)}, ValueError, "conv_state must have shape [S, C, W-1]"),
    ("state-int", {"conv_state": torch.zeros(S, 6, W - 1, dtype=torch.int32)}, TypeError, "conv_state must be"),
    ("no-indices", {"state_indices": None}, ValueError, "conv_state needs state_indices"),
    ("indices-without-state", {"conv_state": None, "has_initial_state": None}, ValueError,
     "state_indices was given without conv_state"),
    ("dup-indices", {"state_indices": torch.tensor([3, 3], dtype=i32)}, ValueError, "duplicates [3]"),
    ("cu-last", {"cu_seqlens": torch.tensor([0, 3, T + 1], dtype=i32)}, ValueError, "cu_seqlens[-1] must equal"),
    ("activation", {"activation": "gelu"}, ValueError, "activation must be 'silu' or None"),
]


@pytest.mark.parametrize("overrides,exc,fragment", [c[1:] for c in CONV_ERRORS], ids=[c[0] for c in CONV_ERRORS])
def test_short_conv_errors(overrides, exc, fragment):
    args = _conv_args()
    args.update(overrides)
    x, weight, cu = args.pop("x"), args.pop("weight"), args.pop("cu_seqlens")
    if exc is None:
        assert kda.short_conv(x, weight, cu, **args, backend="reference").shape == (T, 6)
        return
    with pytest.raises(exc, match="^short_conv: ") as info:
        kda.short_conv(x, weight, cu, **args, backend="reference")
    assert fragment in str(info.value)


def test_short_conv_update_errors():
    state = torch.zeros(S, 6, W - 1)
    ok = kda.short_conv_update(torch.randn(2, 6), torch.randn(6, W), state, torch.tensor([0, 2], dtype=i32),
                               backend="reference")
    assert ok.shape == (2, 6)
    with pytest.raises(ValueError, match=r"state_indices must lie in \[0, 4\)"):
        kda.short_conv_update(torch.randn(2, 6), torch.randn(6, W), state, torch.tensor([0, 4], dtype=i32))
    with pytest.raises(ValueError, match="state_indices must have shape"):
        kda.short_conv_update(torch.randn(2, 6), torch.randn(6, W), state, torch.tensor([0], dtype=i32))
    with pytest.raises(ValueError, match=r"conv_state must have shape \[S, C, W-1\]"):
        kda.short_conv_update(torch.randn(2, 6), torch.randn(6, 3), state, torch.tensor([0, 1], dtype=i32))


def _decode_args() -> dict:
    C = 3 * H * K
    return {
        "qkv": torch.randn(N, C), "f": torch.randn(N, H * K), "beta": torch.randn(N, H),
        "out_gate": torch.randn(N, H * K),
        "conv_weight": torch.randn(C, W), "conv_state": torch.zeros(S, C, W - 1), "A_log": torch.zeros(H),
        "dt_bias": torch.zeros(H * K), "o_norm_weight": torch.ones(K), "state": torch.zeros(S, H, K, K),
        "state_indices": torch.tensor([3, 1], dtype=i32),
    }


DECODE_ERRORS = [
    ("ok", {}, {}, None, ""),
    ("heads-indivisible", {}, {"num_heads": 5}, ValueError, "qkv must have shape [N, 3*H*K] with H=5"),
    ("heads-zero", {}, {"num_heads": 0}, ValueError, "num_heads must be a positive int"),
    ("f-shape", {"f": torch.randn(N, H * K + 1)}, {}, ValueError, "f must have shape [N, H*K]"),
    ("beta-shape", {"beta": torch.randn(N + 1, H)}, {}, ValueError, "beta must have shape [N, H]"),
    ("state-fp16", {"state": torch.zeros(S, H, K, K).half()}, {}, TypeError, "state must be float32"),
    ("conv-pool-size", {"conv_state": torch.zeros(S + 1, 3 * H * K, W - 1)}, {}, ValueError,
     "conv_state must have shape [S, 3*H*K, W-1]"),
    ("norm-weight", {"o_norm_weight": torch.ones(K + 1)}, {}, ValueError, "o_norm_weight must have shape [V]"),
    ("A_log-bf16", {"A_log": torch.zeros(H).bfloat16()}, {}, TypeError, "A_log must be float32"),
    ("dup-slots", {"state_indices": torch.tensor([2, 2], dtype=i32)}, {}, ValueError, "duplicates [2]"),
    ("slot-range", {"state_indices": torch.tensor([0, S], dtype=i32)}, {}, ValueError, "must lie in [0, 4)"),
    ("eps", {}, {"eps": 0.0}, ValueError, "eps must be > 0"),
    ("bound", {}, {"lower_bound": 0.0}, ValueError, "lower_bound must be < 0"),
]


@pytest.mark.parametrize("overrides,kwargs,exc,fragment", [c[1:] for c in DECODE_ERRORS],
                         ids=[c[0] for c in DECODE_ERRORS])
def test_decode_errors(overrides, kwargs, exc, fragment):
    args = _decode_args()
    args.update(overrides)
    options = {"num_heads": H, "lower_bound": -5.0, **kwargs}
    if exc is None:
        assert kda.kda_decode(**args, **options, backend="reference").shape == (N, H * K)
        return
    with pytest.raises(exc, match="^kda_decode: ") as info:
        kda.kda_decode(**args, **options, backend="reference")
    assert fragment in str(info.value)


def test_gate_and_norm_errors():
    with pytest.raises(ValueError, match=r"kda_gate: dt_bias must have shape \[H\*K\] = \[16\], got \[8\]"):
        kda.kda_gate(torch.randn(T, H, K), torch.zeros(H), torch.zeros(K), -5.0)
    with pytest.raises(TypeError, match="kda_gate: A_log must be float32, got bfloat16"):
        kda.kda_gate(torch.randn(T, H, K), torch.zeros(H).bfloat16(), torch.zeros(H * K), None)
    with pytest.raises(ValueError, match="kda_gate: f must be 3-D"):
        kda.kda_gate(torch.randn(T, H * K), torch.zeros(H), torch.zeros(H * K), None)
    with pytest.raises(ValueError, match=r"gated_rms_norm: gate must have shape \[T, H, D\]"):
        kda.gated_rms_norm(torch.randn(T, H, K), torch.randn(T, H, K + 1), torch.ones(K))
    with pytest.raises(ValueError, match=r"gated_rms_norm: weight must have shape \[D\] = \[8\]"):
        kda.gated_rms_norm(torch.randn(T, H, K), torch.randn(T, H, K), torch.ones(H * K))
