"""Token-by-token KDA recurrence: the independent test twin of the chunked reference.

Written from K3_SPEC section 2 step 5 only, without any of the chunked machinery, so that agreement between
this loop and :func:`rocm_k3.ops.kda.reference.kda_prefill` is evidence that both are right. It is slow
(one small update per token) and meant for tests, including the kernel tests of other backends:
:func:`kda_recurrent_naive` runs one sequence from already-prepared inputs, :func:`kda_prefill_naive` takes
the arguments of the ``kda_prefill`` op (varlen batch, state pool, gate/l2norm/beta options, intermediate
positions) and prepares them with its own copy of the formulas.
"""

from __future__ import annotations

import torch

from rocm_k3.ops.kda.datatypes import KDAGateParams, KDAPrefillOutput


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _recur(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    S: torch.Tensor, snapshots_after: set[int],
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The token loop on prepared inputs of one dtype; S [H, K, V] is the initial state (not modified)."""
    T, H, _ = q.shape
    o = torch.empty(T, H, v.shape[-1], dtype=S.dtype, device=S.device)
    snapshots = {}
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)  # decay the key rows            [H, K, V]
        kt = k[t].unsqueeze(-1)  # [H, K, 1]
        u = v[t] - (S * kt).sum(dim=1)  # v_t - S^T k_t                             [H, V]
        S = S + beta[t].view(H, 1, 1) * kt * u.unsqueeze(1)
        o[t] = (S * (scale * q[t]).unsqueeze(-1)).sum(dim=1)  # S^T (scale q_t)    [H, V]
        if t + 1 in snapshots_after:
            snapshots[t + 1] = S
    return o, S, snapshots


def kda_recurrent_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gated delta rule with channel-wise decay over ONE sequence, one token at a time.

    Per token t and head h, with the state ``S`` [K, V]::

        S   = diag(exp(g_t)) S
        u   = v_t - S^T k_t
        S   = S + beta_t k_t u^T
        o_t = S^T (scale * q_t)

    Inputs are used exactly as given: normalise q/k, activate beta (sigmoid) and compute the log-decay g
    beforehand if the model does so.

    Args:
        q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] log-decay; beta: [T, H] (already in (0, 1), not logits).
        scale: multiplies q.
        initial_state: [H, K, V] or None (zeros). Not modified.

    Returns:
        (o [T, H, V], final_state [H, K, V]), both in the compute dtype: float64 if any input is float64,
        else float32.
    """
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    _, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        S = torch.zeros(H, K, V, dtype=dtype, device=q.device)
    else:
        S = initial_state.to(dtype)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    o, S, _ = _recur(q, k, v, g, beta, scale, S, set())
    return o, S


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + 1e-6)


def _gate(f: torch.Tensor, params: KDAGateParams) -> torch.Tensor:
    H, K = f.shape[1], f.shape[2]
    x = f + params.dt_bias.to(f.dtype).view(H, K)  # [T, H, K]
    a = torch.exp(params.A_log.to(f.dtype)).view(H, 1)
    if params.lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return params.lower_bound * torch.sigmoid(a * x)


def kda_prefill_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                      has_initial_state: torch.Tensor, *, scale: float | None = None,
                      gate_params: KDAGateParams | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
                      intermediate_positions: torch.Tensor | None = None,
                      compute_dtype: torch.dtype = torch.float64) -> KDAPrefillOutput:
    """The ``kda_prefill`` op computed token by token, sequence by sequence (same arguments and semantics).

    Gate, L2 norm (``x / sqrt(sum x^2 + 1e-6)``, q then times scale, default K^-0.5) and beta sigmoid are
    applied here in ``compute_dtype`` (default float64). Final states are written in place to
    ``state[state_indices[i]]`` (cast to the pool's dtype). Returns KDAPrefillOutput with o [T, H, V] and the
    intermediate states [M, H, K, V] both in ``compute_dtype`` (not cast, so tests can compare at any tolerance).
    """
    T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(compute_dtype) for t in (q, k, v, g, beta))
    if gate_params is not None:
        g = _gate(g, gate_params)
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if beta_logits:
        beta = torch.sigmoid(beta)
    rows = [] if intermediate_positions is None else intermediate_positions.tolist()
    bounds, slots, has_init = cu_seqlens.tolist(), state_indices.tolist(), has_initial_state.tolist()
    o = torch.zeros(T, H, V, dtype=compute_dtype, device=q.device)
    finals = []
    snapshots: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(len(bounds) - 1):
        sl = slice(bounds[i], bounds[i + 1])
        if has_init[i]:
            S0 = state[slots[i]].to(compute_dtype)
        else:
            S0 = torch.zeros(H, K, V, dtype=compute_dtype, device=q.device)
        wanted = {p for seq, p in rows if seq == i}
        o[sl], S, snaps = _recur(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, S0, wanted)
        finals.append(S)
        snapshots.update({(i, p): s for p, s in snaps.items()})
    for slot, S in zip(slots, finals):  # after all reads, as the op does
        state[slot] = S.to(state.dtype)
    intermediate = None
    if intermediate_positions is not None:
        intermediate = torch.zeros(len(rows), H, K, V, dtype=compute_dtype, device=q.device)
        for m, (seq, p) in enumerate(rows):
            intermediate[m] = snapshots[(seq, p)]
    return KDAPrefillOutput(o, intermediate)
