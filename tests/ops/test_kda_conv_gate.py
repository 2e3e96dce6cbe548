"""KDA short convolution, decay gate and gated RMSNorm against independent formulations.

short_conv: torch.nn.functional.conv1d per sequence (fp32, tolerance 1e-6 relative); conv states hold raw
inputs, so they are compared exactly. kda_gate: python-float math at single points (1e-6 relative).
gated_rms_norm: the formula in float64 (fp32 tolerance 1e-6, bf16 output 1e-2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rocm_k3.ops import kda
from tests.helpers import assert_rel, seeded
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread)

CONV_TOL = 1e-6


def _cu(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32)


def _conv1d_ref(x_seq: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None, activation) -> torch.Tensor:
    """conv1d over (history, x_seq) with W-1 left zero padding; returns the rows of x_seq. x_seq [L, C]."""
    C, W = weight.shape
    if x_seq.shape[0] == 0:
        return torch.zeros(0, C, dtype=torch.float64)
    hist = torch.zeros(W - 1, C, dtype=torch.float64) if history is None else history.double().t()
    full = torch.cat([hist, x_seq.double()])  # [W-1+L, C]
    y = F.conv1d(full.t().unsqueeze(0), weight.double().unsqueeze(1), groups=C)[0].t()  # [L, C]
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "identity"])
@pytest.mark.parametrize("W", [2, 4])
def test_short_conv_matches_conv1d(W, activation):
    lengths = (1, 2, 3, 5, 64, 100)
    gen = seeded(W)
    x = torch.randn(sum(lengths), 24, generator=gen)
    weight = torch.randn(24, W, generator=gen)
    cu = _cu(lengths)
    y = kda.short_conv(x, weight, cu, activation=activation, backend="reference")
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        assert_rel(y[sl], _conv1d_ref(x[sl], weight, None, activation), CONV_TOL, f"seq {i}")


def test_short_conv_with_state_equals_history():
    """Initial conv state = the W-1 inputs before the sequence; the state afterwards = its last W-1 inputs
    (zero-padded on the left when history + sequence is shorter); untouched / fresh slots behave."""
    lengths = (1, 2, 7, 0, 40)
    W, C, S = 4, 16, 8
    gen = seeded(9)
    x = torch.randn(sum(lengths), C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    pool = torch.randn(S, C, W - 1, generator=gen)
    slots = [6, 0, 3, 2, 5]
    has = [True, False, True, True, False]
    pool[0] = float("nan")  # fresh sequence's slot: must not be read
    conv_state = pool.clone()
    cu = _cu(lengths)
    y = kda.short_conv(x, weight, cu, conv_state=conv_state, state_indices=torch.tensor(slots, dtype=torch.int32),
                       has_initial_state=torch.tensor(has), backend="reference")
    for i, slot in enumerate(slots):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        history = pool[slot] if has[i] else torch.zeros(C, W - 1)
        assert_rel(y[sl], _conv1d_ref(x[sl], weight, history, "silu"), CONV_TOL, f"seq {i}")
        inputs = torch.cat([history.t(), x[sl]])  # [W-1+L, C], oldest first
        assert torch.equal(conv_state[slot], inputs[-(W - 1):].t()), f"conv state of seq {i} (slot {slot})"
    for slot in set(range(S)) - set(slots):
        assert torch.equal(conv_state[slot], pool[slot]), f"untouched slot {slot} changed"


def test_short_conv_state_without_history_is_zero_padded():
    W, C = 4, 5
    x = torch.randn(2, C, generator=seeded(2))  # shorter than W-1
    conv_state = torch.full((1, C, W - 1), 7.0)
    kda.short_conv(x, torch.randn(C, W, generator=seeded(3)), _cu([2]), conv_state=conv_state,
                   state_indices=torch.tensor([0], dtype=torch.int32), backend="reference")
    expected = torch.stack([torch.zeros(C), x[0], x[1]], dim=-1)  # [C, W-1]
    assert torch.equal(conv_state[0], expected)


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "identity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_conv_update_chain_equals_prefill(dtype, activation):
    """N sequences stepped token by token with short_conv_update == one varlen short_conv from the same state."""
    N, L, C, W, S = 3, 9, 12, 4, 6
    gen = seeded(13)
    x = torch.randn(N, L, C, generator=gen).to(dtype)
    weight = torch.randn(C, W, generator=gen).to(dtype)
    pool = torch.randn(S, C, W - 1, generator=gen).to(dtype)
    slots = torch.tensor([5, 1, 2], dtype=torch.int32)
    prefill_state = pool.clone()
    y_pre = kda.short_conv(x.reshape(N * L, C), weight, torch.arange(N + 1, dtype=torch.int32) * L,
                           conv_state=prefill_state, state_indices=slots,
                           has_initial_state=torch.ones(N, dtype=torch.bool), activation=activation,
                           backend="reference")
    step_state = pool.clone()
    y_steps = torch.stack(
        [kda.short_conv_update(x[:, t], weight, step_state, slots, activation, backend="reference") for t in range(L)],
        dim=1,
    )
    # fp32: both paths sum W products in fp32 (order may differ); bf16: at most an ulp (2^-8) from the cast
    tol = CONV_TOL if dtype == torch.float32 else 1e-2
    assert y_steps.dtype == dtype
    assert_rel(y_steps.reshape(N * L, C), y_pre, tol, "short_conv_update chain vs short_conv")
    assert torch.equal(step_state, prefill_state), "conv states hold raw inputs on both paths"
    for i in range(N):
        ref = _conv1d_ref(x[i].float(), weight.float(), pool[slots[i]].float(), activation)
        assert_rel(y_steps[i], ref, tol, f"seq {i} vs conv1d")


# ---- gate ----

GATE_POINTS = [(0, 0, 0.3), (1, 3, -2.0), (2, 7, 4.5), (0, 5, -0.01)]  # (h, d, f)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe", "softplus"])
def test_gate_hand_computed(lower_bound):
    H, K = 3, 8
    A_log = torch.tensor([0.0, math.log(2.5), math.log(0.1)])
    dt_bias = torch.linspace(-1.0, 1.0, H * K)
    f = torch.zeros(1, H, K)
    for h, d, value in GATE_POINTS:
        f[0, h, d] = value
    g = kda.kda_gate(f, A_log, dt_bias, lower_bound, backend="reference")
    assert g.dtype == torch.float32 and g.shape == (1, H, K)
    for h, d, value in GATE_POINTS:
        a = math.exp(float(A_log[h]))
        x = value + float(dt_bias[h * K + d])
        if lower_bound is None:
            expected = -a * math.log1p(math.exp(x))
        else:
            expected = lower_bound / (1.0 + math.exp(-a * x))
        got = float(g[0, h, d])
        assert abs(got - expected) <= 1e-6 * abs(expected), f"g[{h},{d}] = {got}, expected {expected}"


def test_safe_gate_range():
    """g in (-5, 0) strictly while |exp(A_log) (f + dt_bias)| stays below fp32 sigmoid saturation (~16);
    in [-5, 0] for any input, however large."""
    H, K = 4, 16
    gen = seeded(17)
    A_log = torch.zeros(H)
    f = torch.randn(200, H, K, generator=gen).bfloat16()
    g = kda.kda_gate(f, A_log, 0.5 * torch.randn(H * K, generator=gen), -5.0, backend="reference")
    assert g.dtype == torch.float32
    assert bool(((g > -5.0) & (g < 0.0)).all()), f"safe gate left (-5, 0): [{g.min()}, {g.max()}]"
    extreme = kda.kda_gate(1e4 * torch.randn(50, H, K, generator=gen), A_log + 3.0, torch.zeros(H * K), -5.0,
                           backend="reference")
    assert bool(((extreme >= -5.0) & (extreme <= 0.0)).all())


# ---- gated RMSNorm ----


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_gated_rms_norm_formula(dtype, tol):
    T, H, D, eps = 7, 3, 32, 1e-5
    gen = seeded(19)
    x = (3.0 * torch.randn(T, H, D, generator=gen)).to(dtype)
    gate = torch.randn(T, H, D, generator=gen).to(dtype)
    weight = torch.randn(D, generator=gen).to(dtype)
    y = kda.gated_rms_norm(x, gate, weight, eps, backend="reference")
    x64 = x.double()
    rms = torch.sqrt((x64 * x64).sum(-1, keepdim=True) / D + eps)
    ref = x64 / rms * weight.double() / (1 + torch.exp(-gate.double()))
    assert y.dtype == dtype
    assert_rel(y, ref, tol, "gated_rms_norm")
