"""Triton ``kda_decode``: one KDA decode step per sequence in ONE kernel, one program per (sequence, head).

For sequence n (state slot s = state_indices[n]) and head h, with V = K::

    q, k, v = SiLU(short_conv_update(qkv[n] channels of head h))      conv_state[s] shifted in place
    g       = kda_gate(f[n, h])                                       fp32 [K]
    q       = scale * q / sqrt(sum q^2 + 1e-6);  k = k / sqrt(sum k^2 + 1e-6);  b = sigmoid(beta[n, h])
    S       = diag(exp(g)) state[s, h];  u = v - S^T k;  S += b k u^T;  o = S^T q     state[s, h] <- S in place
              (o is computed as S_decayed^T q + b (k . q) u, so both K-reductions read one tile side by side)
    y       = o * rsqrt(mean(o^2) + eps) * o_norm_weight * sigmoid(out_gate[n, h])

The state slots are addressed by index inside the kernel: no gather or scatter copies. Everything except
the [K, V] fp32 state is a few hundred bytes, so the kernel is bound by reading and writing the state.
Signature and semantics: :func:`rocm_k3.ops.kda.kda_decode` (minus ``backend``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.common import gate, is_pow2, sigmoid_f32

# Warps per (sequence, head) program: the [K, V] fp32 state tile is spread over them (64 KB at K = 128).
# Load the state tile before the conv/gate/norm prologue (latency overlap) or after it (fewer live registers).
# H200, K3 shapes, 2026-11-29: 4 warps with the late load ran at 76-83% of copy bandwidth; 8 warps 50-60%,
# 16 warps 40-50%, and every warp count was slower with the early load (fewer programs fit per SM).
DECODE_WARPS = 4
DECODE_PREFETCH = False


@triton.jit
def _conv_channels(x_row_ptr, w_ptr, state_row_ptr, ch, W: tl.constexpr, WP: tl.constexpr):
    """SiLU(causal conv) of one decode token on channels ``ch`` [D] -> (fp32 [D], new history [D, WP], its
    pointers, its mask). The caller stores the new history after a barrier: a tile may be replicated across
    warps, and no warp may overwrite a history entry another warp has still to read."""
    jj = tl.arange(0, WP)
    mj = (jj < W - 1)[None, :]
    hist = state_row_ptr + ch[:, None] * (W - 1) + jj[None, :]  # [D, WP]
    hv = tl.load(hist, mask=mj, other=0.0)
    wt = tl.load(w_ptr + ch[:, None] * W + jj[None, :], mask=mj, other=0.0).to(tl.float32)
    x = tl.load(x_row_ptr + ch)
    acc = tl.sum(hv.to(tl.float32) * wt, axis=1) + tl.load(w_ptr + ch * W + (W - 1)).to(tl.float32) * x.to(tl.float32)
    shifted = tl.load(hist + 1, mask=(jj + 1 < W - 1)[None, :], other=0.0)
    new = tl.where((jj == W - 2)[None, :], x[:, None].to(hv.dtype), shifted)
    return acc / (1.0 + tl.exp(-acc)), new, hist, mj


@triton.jit
def kda_decode_kernel(
    qkv_ptr, f_ptr, beta_ptr, out_gate_ptr,  # [N, 3HK], [N, HK], [N, H], [N, HV]
    conv_w_ptr, conv_state_ptr,  # [3HK, W], [S, 3HK, W-1]
    a_log_ptr, dt_bias_ptr, norm_w_ptr,  # fp32 [H], fp32 [HK], [V]
    state_ptr, state_indices_ptr, y_ptr,  # fp32 [S, H, K, V], int32 [N], [N, HV]
    scale, lower_bound, eps,
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, SAFE_GATE: tl.constexpr,
    PREFETCH_STATE: tl.constexpr,
):
    V: tl.constexpr = K
    n = tl.program_id(0)
    h = tl.program_id(1)
    C: tl.constexpr = 3 * H * K
    slot = tl.load(state_indices_ptr + n).to(tl.int64)
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)

    s_ptr = state_ptr + (slot * H + h) * (K * V) + rk[:, None] * V + rv[None, :]  # [K, V]
    if PREFETCH_STATE:  # issue the state load first: its DRAM latency overlaps the conv, gate and norm work
        s = tl.load(s_ptr)  # (at the cost of holding the tile in registers meanwhile)
    og = tl.load(out_gate_ptr + n.to(tl.int64) * (H * V) + h * V + rv).to(tl.float32)
    nw = tl.load(norm_w_ptr + rv).to(tl.float32)
    f = tl.load(f_ptr + n.to(tl.int64) * (H * K) + h * K + rk)
    g = gate(f, tl.load(a_log_ptr + h), tl.load(dt_bias_ptr + h * K + rk), lower_bound, SAFE_GATE)  # [K]
    b = sigmoid_f32(tl.load(beta_ptr + n.to(tl.int64) * H + h).to(tl.float32))

    x_row = qkv_ptr + n.to(tl.int64) * C
    hist_row = conv_state_ptr + slot * (C * (W - 1))
    q, q_hist, q_hptr, mj = _conv_channels(x_row, conv_w_ptr, hist_row, h * K + rk, W, WP)  # [K] fp32
    k, k_hist, k_hptr, mj = _conv_channels(x_row, conv_w_ptr, hist_row, H * K + h * K + rk, W, WP)
    v, v_hist, v_hptr, mj = _conv_channels(x_row, conv_w_ptr, hist_row, 2 * H * K + h * V + rv, W, WP)  # [V]
    tl.debug_barrier()  # every history entry is read before any is overwritten
    tl.store(q_hptr, q_hist, mask=mj)
    tl.store(k_hptr, k_hist, mask=mj)
    tl.store(v_hptr, v_hist, mask=mj)

    q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)

    if not PREFETCH_STATE:
        s = tl.load(s_ptr)
    s = s * tl.exp(g)[:, None]  # decayed state
    # both reductions over K read the decayed state, so they run side by side:
    # o = S_new^T q = S^T q + b (k . q) u  with  u = v - S^T k
    u = v - tl.sum(s * k[:, None], axis=0)  # [V]
    sq = tl.sum(s * q[:, None], axis=0)  # [V]
    tl.store(s_ptr, s + (b * k)[:, None] * u[None, :])
    o = sq + (b * tl.sum(k * q, axis=0)) * u

    y = o / tl.sqrt(tl.sum(o * o, axis=0) / V + eps) * nw * sigmoid_f32(og)
    tl.store(y_ptr + n.to(tl.int64) * (H * V) + h * V + rv, y.to(y_ptr.dtype.element_ty))


def supports_kda_decode(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, out_gate: torch.Tensor,
                        conv_weight: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        o_norm_weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *,
                        num_heads: int, lower_bound: float | None, scale: float | None = None,
                        eps: float = 1e-5) -> tuple[bool, str]:
    """(ok, reason): head dim a power of two <= 128, width >= 2, contiguous fp32 state and contiguous conv state."""
    K = qkv.shape[1] // (3 * num_heads)
    if not (is_pow2(K) and K <= 128):
        return False, f"triton kda_decode needs the head dim a power of two <= 128, got {K}"
    if conv_weight.shape[1] < 2:
        return False, f"triton kda_decode needs a conv width >= 2, got {conv_weight.shape[1]}"
    if state.dtype != torch.float32 or not state.is_contiguous():
        return False, "triton kda_decode updates the state in place: it must be contiguous fp32"
    if not conv_state.is_contiguous():
        return False, "triton kda_decode updates conv_state in place: it must be contiguous"
    return True, "supported"


def kda_decode(qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, out_gate: torch.Tensor,
               conv_weight: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               o_norm_weight: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *, num_heads: int,
               lower_bound: float | None, scale: float | None = None, eps: float = 1e-5) -> torch.Tensor:
    """One fused decode step (module docstring). Returns y [N, H*V] in qkv's dtype; state and conv_state are
    updated in place at ``state_indices``."""
    N = qkv.shape[0]
    H = num_heads
    K = qkv.shape[1] // (3 * H)
    y = torch.empty(N, H * K, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return y
    scale = K**-0.5 if scale is None else float(scale)
    W = conv_weight.shape[1]
    kda_decode_kernel[(N, H)](
        qkv.contiguous(), f.contiguous(), beta.contiguous(), out_gate.contiguous(),
        conv_weight.contiguous(), conv_state, A_log.float().contiguous(), dt_bias.float().contiguous(),
        o_norm_weight.contiguous(), state, state_indices.to(torch.int32).contiguous(), y,
        scale, 0.0 if lower_bound is None else float(lower_bound), float(eps),
        H=H, K=K, W=W, WP=triton.next_power_of_2(W - 1), SAFE_GATE=lower_bound is not None,
        PREFETCH_STATE=DECODE_PREFETCH, num_warps=DECODE_WARPS,
    )
    return y
