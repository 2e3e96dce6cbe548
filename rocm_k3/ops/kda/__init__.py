"""Kimi Delta Attention (KDA) ops: the public signatures, their boundary checks, and dispatch.

Conventions: T tokens of a varlen batch (sequences concatenated), N sequences, ``cu_seqlens`` int32 [N+1],
H heads, K key dim, V value dim, S state slots of a pool, C channels, W conv width. Recurrent states are fp32
[S, H, K, V] (key dim first); conv states are [S, C, W-1], oldest input first. Every op checks its arguments
(ValueError for shapes/values, TypeError for types) and runs on the backend chosen by
:func:`rocm_k3.ops.registry.dispatch`; the references live in :mod:`rocm_k3.ops.kda.reference` and the
token-by-token test twin in :mod:`rocm_k3.ops.kda.naive`. Math: K3_SPEC section 2.
"""

from __future__ import annotations

import torch

from rocm_k3.ops import registry
from rocm_k3.ops.kda import reference
from rocm_k3.ops.kda import validation as check
from rocm_k3.ops.kda.datatypes import KDAGateParams, KDAPrefillOutput

__all__ = [
    "REFERENCE_IMPLS",
    "KDAGateParams",
    "KDAPrefillOutput",
    "gated_rms_norm",
    "kda_decode",
    "kda_gate",
    "kda_prefill",
    "short_conv",
    "short_conv_update",
]

FP32 = (torch.float32,)


def _check_gate_params(op: str, A_log: object, dt_bias: object, lower_bound: object, H: int, K: int) -> None:
    A_log = check.shape(op, "A_log", A_log, (H,), "[H]")
    check.dtype(op, "A_log", A_log, FP32)
    dt_bias = check.shape(op, "dt_bias", dt_bias, (H * K,), "[H*K]")
    check.dtype(op, "dt_bias", dt_bias, FP32)
    check.lower_bound(op, lower_bound)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None, *,
             backend: str | None = None) -> torch.Tensor:
    """Log-space decay gate g fp32 [T, H, K] from the raw gate input f [T, H, K] (bf16/fp16/fp32).

    Safe gate (lower_bound L < 0): ``g = L * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))``, in (L, 0).
    Softplus gate (lower_bound None): ``g = -exp(A_log[h]) * softplus(f + dt_bias[h])``.
    A_log fp32 [H]; dt_bias fp32 [H*K] (head-major).
    """
    op = "kda_gate"
    f = check.rank(op, "f", f, 3, "[T, H, K]")
    check.activation_dtype(op, "f", f)
    _, H, K = f.shape
    _check_gate_params(op, A_log, dt_bias, lower_bound, H, K)
    check.same_device(op, {"f": f, "A_log": A_log, "dt_bias": dt_bias})
    return registry.dispatch(op, backend, f, A_log, dt_bias, lower_bound)


def short_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, *,
               conv_state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
               has_initial_state: torch.Tensor | None = None, activation: str | None = "silu",
               backend: str | None = None) -> torch.Tensor:
    """Causal depthwise conv (no bias) per sequence of a varlen batch, then SiLU (activation None: identity).

    x [T, C], weight [C, W], cu_seqlens int32 [N+1]; returns y [T, C] in x's dtype, with
    ``y[t, c] = act(sum_j weight[c, j] * h[t - (W-1) + j, c])`` over the sequence's inputs h, preceded by a
    history of W-1 inputs.
    conv_state [S, C, W-1] (optional, updated in place) with state_indices int32 [N] (required with it) and
    has_initial_state bool [N] (None = False for all): the history of sequence i is
    ``conv_state[state_indices[i]]`` if has_initial_state[i] else zeros, and afterwards that slot holds the last
    W-1 inputs of (history, sequence), oldest first.
    """
    op = "short_conv"
    x, weight = check.conv_inputs(op, x, weight, "[T, C]")
    (T, C), W = x.shape, weight.shape[1]
    N = check.cu_seqlens(op, cu_seqlens, T, values=registry.checks_values(backend))
    if conv_state is None:
        for name, value in (("state_indices", state_indices), ("has_initial_state", has_initial_state)):
            if value is not None:
                raise ValueError(f"{op}: {name} was given without conv_state")
    else:
        conv_state = check.conv_state(op, conv_state, C, W)
        if state_indices is None:
            raise ValueError(f"{op}: conv_state needs state_indices int32 [N] (N={N}), got None")
        check.state_indices(op, state_indices, N, conv_state.shape[0], values=registry.checks_values(backend))
        if has_initial_state is not None:
            check.has_initial_state(op, has_initial_state, N)
    check.conv_activation(op, activation)
    check.same_device(
        op,
        {"x": x, "weight": weight, "cu_seqlens": cu_seqlens, "conv_state": conv_state,
         "state_indices": state_indices, "has_initial_state": has_initial_state},
    )
    return registry.dispatch(
        op, backend, x, weight, cu_seqlens, conv_state=conv_state, state_indices=state_indices,
        has_initial_state=has_initial_state, activation=activation,
    )


def short_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                      activation: str | None = "silu", *, backend: str | None = None) -> torch.Tensor:
    """Decode step of :func:`short_conv`: one new token per sequence.

    x [N, C], weight [C, W], conv_state [S, C, W-1] (oldest first), state_indices int32 [N].
    ``y[i] = act(sum_j weight[:, j] * window[:, j])`` with window = (conv_state[slot_i], x[i]) [C, W]; the slot
    is shifted in place to the window's last W-1 inputs. Returns y [N, C] in x's dtype.
    """
    op = "short_conv_update"
    x, weight = check.conv_inputs(op, x, weight, "[N, C]")
    (N, C), W = x.shape, weight.shape[1]
    conv_state = check.conv_state(op, conv_state, C, W)
    check.state_indices(op, state_indices, N, conv_state.shape[0], values=registry.checks_values(backend))
    check.conv_activation(op, activation)
    check.same_device(op, {"x": x, "weight": weight, "conv_state": conv_state, "state_indices": state_indices})
    return registry.dispatch(op, backend, x, weight, conv_state, state_indices, activation)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, *, scale: float | None = None,
                gate_params: KDAGateParams | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
                intermediate_positions: torch.Tensor | None = None, backend: str | None = None) -> KDAPrefillOutput:
    """KDA over a varlen batch of new tokens, continuing (or starting) each sequence's recurrent state.

    q, k [T, H, K] and v [T, H, V] share one dtype (bf16/fp16/fp32); beta [T, H]; cu_seqlens int32 [N+1];
    state fp32 [S, H, K, V]; state_indices int32 [N] (distinct); has_initial_state bool [N].
    - g [T, H, K]: the fp32 log-decay, or, when gate_params = KDAGateParams(A_log, dt_bias, lower_bound) is
      given, the raw gate input f (any float dtype) to which :func:`kda_gate` is applied first.
    - qk_l2norm: q and k are L2-normalised per head (``x / sqrt(sum x^2 + 1e-6)``); q is then scaled by
      ``scale`` (default K^-0.5). beta_logits: beta = sigmoid(beta), else beta is used as given.
    - Initial state of sequence i: state[state_indices[i]] if has_initial_state[i] else 0; its final state is
      written in place to state[state_indices[i]].
    - intermediate_positions int32 [M, 2], rows (i, p) with 1 <= p <= len_i: also return the state after the
      first p tokens of sequence i (kernels may accept only p % 64 == 0 or p == len_i and say so).
    Per token: ``S = diag(exp(g_t)) S; u = v_t - S^T k_t; S += beta_t k_t u^T; o_t = S^T q_t``.
    Returns KDAPrefillOutput(o [T, H, V] in v's dtype, intermediate_states fp32 [M, H, K, V] or None).
    """
    op = "kda_prefill"
    q = check.rank(op, "q", q, 3, "[T, H, K]")
    T, H, K = q.shape
    check.shape(op, "k", k, (T, H, K), "[T, H, K]")
    v = check.rank(op, "v", v, 3, "[T, H, V]")
    V = v.shape[2]
    check.shape(op, "v", v, (T, H, V), "[T, H, V]")
    check.shape(op, "g", g, (T, H, K), "[T, H, K]")
    check.shape(op, "beta", beta, (T, H), "[T, H]")
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        check.activation_dtype(op, name, t)
    check.same_dtype(op, {"q": q, "k": k, "v": v})
    if gate_params is None:
        check.dtype(op, "g (the log-decay; pass gate_params to give the raw gate input)", g, FP32)
    else:
        if not isinstance(gate_params, KDAGateParams):
            raise TypeError(f"{op}: gate_params must be a KDAGateParams, got {type(gate_params).__name__}")
        check.activation_dtype(op, "g (the raw gate input, as gate_params is given)", g)
        _check_gate_params(op, *gate_params, H, K)
    N = check.cu_seqlens(op, cu_seqlens, T, values=registry.checks_values(backend))
    state = check.rank(op, "state", state, 4, "[S, H, K, V]")
    check.shape(op, "state", state, (state.shape[0], H, K, V), "[S, H, K, V]")
    check.dtype(op, "state", state, FP32)
    check.state_indices(op, state_indices, N, state.shape[0], values=registry.checks_values(backend))
    check.has_initial_state(op, has_initial_state, N)
    if scale is not None:
        check.finite_float(op, "scale", scale, positive=True)
    for name, flag in (("qk_l2norm", qk_l2norm), ("beta_logits", beta_logits)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(flag).__name__}")
    if intermediate_positions is not None:
        check.intermediate_positions(op, intermediate_positions, cu_seqlens, values=registry.checks_values(backend))
    check.same_device(
        op,
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens, "state": state,
         "state_indices": state_indices, "has_initial_state": has_initial_state,
         "intermediate_positions": intermediate_positions,
         **({"A_log": gate_params.A_log, "dt_bias": gate_params.dt_bias} if gate_params is not None else {})},
    )
    return registry.dispatch(
        op, backend, q, k, v, g, beta, cu_seqlens, state, state_indices, has_initial_state,
        scale=scale, gate_params=gate_params, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
        intermediate_positions=intermediate_positions,
    )


def kda_decode(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, out_gate: torch.Tensor,
               conv_weight: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               o_norm_weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *, num_heads: int,
               lower_bound: float | None, scale: float | None = None, eps: float = 1e-5,
               backend: str | None = None) -> torch.Tensor:
    """One decode token per sequence through a KDA layer, up to (not including) o_proj. V = K.

    qkv [N, 3*H*K] pre-conv projections (q | k | v, head-major) in bf16/fp16/fp32; f [N, H*K] raw gate input;
    beta [N, H] logits; out_gate [N, H*K] output-gate logits; conv_weight [3*H*K, W];
    conv_state [S, 3*H*K, W-1] and state fp32 [S, H, K, K] (same S), both updated in place at
    state_indices int32 [N] (distinct); A_log fp32 [H]; dt_bias fp32 [H*K]; o_norm_weight [K].
    Computes short_conv_update + SiLU, split q|k|v, kda_gate, L2 norms (q scaled, default K^-0.5),
    beta = sigmoid(beta), one recurrence step, then ``gated_rms_norm(o, out_gate, o_norm_weight, eps)``.
    Returns y [N, H*K] in qkv's dtype.
    """
    op = "kda_decode"
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{op}: num_heads must be a positive int, got {num_heads!r}")
    H = num_heads
    qkv = check.rank(op, "qkv", qkv, 2, "[N, 3*H*K]")
    N, width = qkv.shape
    if width % (3 * H) != 0 or width == 0:
        raise ValueError(f"{op}: qkv must have shape [N, 3*H*K] with H={H}, got {list(qkv.shape)}")
    K = width // (3 * H)
    check.shape(op, "f", f, (N, H * K), "[N, H*K]")
    check.shape(op, "beta", beta, (N, H), "[N, H]")
    check.shape(op, "out_gate", out_gate, (N, H * K), "[N, H*V]")
    conv_weight = check.rank(op, "conv_weight", conv_weight, 2, "[3*H*K, W]")
    W = conv_weight.shape[1]
    check.shape(op, "conv_weight", conv_weight, (3 * H * K, W), "[3*H*K, W]")
    state = check.rank(op, "state", state, 4, "[S, H, K, V]")
    S = state.shape[0]
    check.shape(op, "state", state, (S, H, K, K), "[S, H, K, V]")
    check.dtype(op, "state", state, FP32)
    check.shape(op, "conv_state", conv_state, (S, 3 * H * K, W - 1), "[S, 3*H*K, W-1]")
    check.shape(op, "o_norm_weight", o_norm_weight, (K,), "[V]")
    for name, t in (("qkv", qkv), ("f", f), ("beta", beta), ("out_gate", out_gate), ("conv_weight", conv_weight),
                    ("conv_state", conv_state), ("o_norm_weight", o_norm_weight)):
        check.activation_dtype(op, name, t)
    _check_gate_params(op, A_log, dt_bias, lower_bound, H, K)
    check.state_indices(op, state_indices, N, S, values=registry.checks_values(backend))
    if scale is not None:
        check.finite_float(op, "scale", scale, positive=True)
    check.finite_float(op, "eps", eps, positive=True)
    check.same_device(
        op,
        {"qkv": qkv, "f": f, "beta": beta, "out_gate": out_gate, "conv_weight": conv_weight,
         "conv_state": conv_state, "A_log": A_log, "dt_bias": dt_bias, "o_norm_weight": o_norm_weight,
         "state": state, "state_indices": state_indices},
    )
    return registry.dispatch(
        op, backend, qkv, f, beta, out_gate, conv_weight, conv_state, A_log, dt_bias, o_norm_weight, state,
        state_indices, num_heads=num_heads, lower_bound=lower_bound, scale=scale, eps=eps,
    )


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
                   backend: str | None = None) -> torch.Tensor:
    """``RMSNorm_D(x) * weight * sigmoid(gate)``: x, gate [T, H, D]; weight [D]; fp32 math; returns x's dtype."""
    op = "gated_rms_norm"
    x = check.rank(op, "x", x, 3, "[T, H, D]")
    check.shape(op, "gate", gate, tuple(x.shape), "[T, H, D]")
    check.shape(op, "weight", weight, (x.shape[2],), "[D]")
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        check.activation_dtype(op, name, t)
    check.finite_float(op, "eps", eps, positive=True)
    check.same_device(op, {"x": x, "gate": gate, "weight": weight})
    return registry.dispatch(op, backend, x, gate, weight, eps)


REFERENCE_IMPLS = {
    "kda_gate": reference.kda_gate,
    "short_conv": reference.short_conv,
    "short_conv_update": reference.short_conv_update,
    "kda_prefill": reference.kda_prefill,
    "kda_decode": reference.kda_decode,
    "gated_rms_norm": reference.gated_rms_norm,
}
