"""Triton ``kda_gate``: the KDA decay gate as one elementwise kernel.

g[t, h, d] = L * sigmoid(exp(A_log[h]) * (f[t, h, d] + dt_bias[h*K + d]))     (safe gate, lower_bound L)
g[t, h, d] = -exp(A_log[h]) * softplus(f[t, h, d] + dt_bias[h*K + d])         (lower_bound None)
f [T, H, K] any float dtype; g fp32 [T, H, K].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.common import gate, is_pow2

_ROWS = 16  # tokens per program


@triton.jit
def kda_gate_kernel(f_ptr, a_log_ptr, dt_bias_ptr, g_ptr, T, lower_bound,
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, SAFE_GATE: tl.constexpr):
    it = tl.program_id(0)
    h = tl.program_id(1)
    rows = it * BT + tl.arange(0, BT)
    cols = tl.arange(0, K)
    m = (rows < T)[:, None]
    offs = rows.to(tl.int64)[:, None] * (H * K) + h * K + cols[None, :]  # [BT, K]
    f = tl.load(f_ptr + offs, mask=m, other=0.0)
    a_log = tl.load(a_log_ptr + h)
    dt_bias = tl.load(dt_bias_ptr + h * K + cols)  # [K]
    tl.store(g_ptr + offs, gate(f, a_log, dt_bias[None, :], lower_bound, SAFE_GATE), mask=m)


def supports_kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> tuple[bool, str]:
    """(ok, reason): K must be a power of two (one [16, K] tile per program)."""
    K = f.shape[-1]
    if not is_pow2(K):
        return False, f"triton kda_gate needs K a power of two, got {K}"
    return True, "supported"


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Decay gate (module docstring): f [T, H, K], A_log fp32 [H], dt_bias fp32 [H*K] -> g fp32 [T, H, K]."""
    T, H, K = f.shape
    f = f.contiguous()
    g = torch.empty(T, H, K, dtype=torch.float32, device=f.device)
    if T == 0:
        return g
    kda_gate_kernel[(triton.cdiv(T, _ROWS), H)](
        f, A_log.float().contiguous(), dt_bias.float().contiguous(), g, T,
        0.0 if lower_bound is None else float(lower_bound),
        H=H, K=K, BT=_ROWS, SAFE_GATE=lower_bound is not None, num_warps=4,
    )
    return g
