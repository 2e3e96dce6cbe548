"""Named argument and result types of the KDA op family (shared by the public API, references and kernels)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class KDAGateParams(NamedTuple):
    """Parameters of the decay gate, for ``kda_prefill`` to apply :func:`rocm_k3.ops.kda.kda_gate` itself.

    A_log:       fp32 [H]
    dt_bias:     fp32 [H*K]
    lower_bound: the safe-gate bound L < 0 (K3: -5.0), or None for the softplus gate (Kimi Linear).
    """

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    lower_bound: float | None


class KDAPrefillOutput(NamedTuple):
    """Result of ``kda_prefill``.

    o:                   [T, H, V] in v's dtype.
    intermediate_states: fp32 [M, H, K, V], one per row of ``intermediate_positions``; None when none were asked.
    """

    o: torch.Tensor
    intermediate_states: torch.Tensor | None
