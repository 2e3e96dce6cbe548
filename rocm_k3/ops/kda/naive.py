"""Token-by-token KDA recurrence: the independent test twin of the chunked reference.

Written from K3_SPEC section 2 step 5 only, without any of the chunked machinery, so that agreement between
this loop and :func:`rocm_k3.ops.kda.reference.kda_prefill` is evidence that both are right. It is slow
(one small update per token) and meant for tests, including the kernel tests of other backends.
"""

from __future__ import annotations

import torch


def kda_recurrent_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    tensors = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if initial_state is None:
        S = torch.zeros(H, K, V, dtype=dtype, device=q.device)
    else:
        S = initial_state.to(dtype).clone()
    o = torch.empty(T, H, V, dtype=dtype, device=q.device)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)  # decay the key rows           [H, K, V]
        kt = k[t].unsqueeze(-1)  # [H, K, 1]
        u = v[t] - (S * kt).sum(dim=1)  # v_t - S^T k_t                            [H, V]
        S = S + beta[t].view(H, 1, 1) * kt * u.unsqueeze(1)
        o[t] = (S * (scale * q[t]).unsqueeze(-1)).sum(dim=1)  # S^T (scale q_t)   [H, V]
    return o, S
