"""Row kernels of the MoE family: ``situ_and_mul``, ``silu_and_mul`` and the noaux_tc ``route``.

- ``situ_and_mul(x [..., 2N], beta, linear_beta) -> [..., N]``: ``beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb) | u)``
  with g = x[..., :N], u = x[..., N:], fp32 math, x dtype out.
- ``silu_and_mul(x [..., 2N]) -> [..., N]``: ``silu(g) * u``.
- ``route(logits fp32 [T, E], top_k, *, correction_bias, renormalize, scaling_factor) -> RouteResult``:
  one program per token holds the E scores, picks the top-k of ``sigmoid(logit) + bias`` by repeated arg-max (ties
  go to the lower expert index, ids in descending score order), weights ``sigmoid(logit)`` of the chosen experts,
  renormalised to sum 1 if asked, times ``scaling_factor``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_k3.ops.moe import RouteResult

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_EXPERTS = 4096


# sigmoid(x) = 1 / (1 + 2^(-x log2(e))) on the MUFU approximations (each ~2 ulp relative; ftz: beyond |x| ~ 87
# the result is 0 or 1, within 1e-38 of the exact one). 0fBFB8AA3B = -log2(e), 0f3F800000 = 1.
_SIGMOID_PTX = tl.constexpr("{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
                            "add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }")


@triton.jit
def sigmoid_f32(x, FAST: tl.constexpr):
    """fp32 sigmoid: ``tl.sigmoid`` (``1 / (1 + exp(-x))``; on NVIDIA its division is ``div.full.f32`` with its
    range handling), or FAST (NVIDIA only: inline PTX) four instructions on the MUFU ex2 / rcp approximations, a
    few ulp from it."""
    if FAST:
        return tl.inline_asm_elementwise(_SIGMOID_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.sigmoid(x)


@triton.jit
def tanh_f32(z, FAST: tl.constexpr = False):
    """fp32 tanh with a small relative error everywhere (also used by the MoE GEMM epilogue; FAST: its sigmoid
    on :func:`sigmoid_f32`'s NVIDIA fast path).

    ``2 sigmoid(2z) - 1`` alone cancels near 0 (absolute error ~1e-7, i.e. ~2.5e-5 relative at z = 0.004, which
    SiTU's ``25 tanh(u / 25)`` hits for |u| ~ 0.1), so |z| < 0.25 uses the odd Taylor polynomial through z^9
    (truncation < 1e-8 relative there).
    """
    z2 = z * z
    poly = z * (1.0 + z2 * (-0.3333333333333333 + z2 * (0.13333333333333333 + z2 * (-0.05396825396825397
                                                                                       + z2 * 0.021869488536155203))))
    return tl.where(tl.abs(z) < 0.25, poly, 2.0 * sigmoid_f32(2.0 * z, FAST) - 1.0)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n_rows, n, stride_x, stride_out, beta, linear_beta,
                        SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # gate half
    u = tl.load(x_ptr + r64 * stride_x + n + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # up half
    if SITU:
        gate = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LINEAR_BETA:
            u = linear_beta * tanh_f32(u / linear_beta)
    else:
        gate = g * tl.sigmoid(g)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], (gate * u).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, situ: bool, beta: float, linear_beta: float | None) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        rows = max(1, min(16, 2048 // block))
        _act_and_mul_kernel[(triton.cdiv(x2.shape[0], rows), triton.cdiv(n, block))](
            x2, out, x2.shape[0], n, x2.stride(0), out.stride(0), float(beta), float(linear_beta or 1.0),
            SITU=situ, HAS_LINEAR_BETA=linear_beta is not None, ROWS=rows, BLOCK=block,
        )
    return out.view(*x.shape[:-1], n)


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU(gate) * (linear-SiTU(up)): ``x [..., 2N]`` -> ``[..., N]`` in x dtype."""
    return _act_and_mul(x, True, beta, linear_beta)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: ``x [..., 2N]`` -> ``[..., N]`` in x dtype."""
    return _act_and_mul(x, False, 1.0, None)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, num_experts, stride_l, scaling_factor,
                  TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per token. Each expert's selection score and index are packed into one int64 key (the score's
    order-preserving integer above ``BLOCK_E - 1 - index``, so that among equal scores the lower index is the
    larger key): one max reduction per pick gives the expert, and the chosen weights are loaded once at the end."""
    t = tl.program_id(0).to(tl.int64)
    ex = tl.arange(0, BLOCK_E)
    emask = ex < num_experts
    row = logits_ptr + t * stride_l
    select = tl.sigmoid(tl.load(row + ex, mask=emask, other=0.0))  # [E]
    if HAS_BIAS:
        select = select + tl.load(bias_ptr + ex, mask=emask, other=0.0)
    bits = (select + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 ties with 0.0, as the float compare does
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # [E] int32 in the floats' order (NaN above +inf)
    keys = (order.to(tl.int64) << 32) | (BLOCK_E - 1 - ex).to(tl.int64)  # [E]
    gone = tl.full((BLOCK_E,), -9223372036854775807 - 1, tl.int64)  # below every key: padding, picked experts
    keys = tl.where(emask, keys, gone)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    for j in range(TOP_K):
        best = tl.max(keys, axis=0)
        ids = tl.where(kk == j, (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32), ids)
        keys = tl.where(keys == best, gone, keys)
    kmask = kk < TOP_K
    weights = tl.sigmoid(tl.load(row + ids, mask=kmask, other=0.0))  # [K] the same scores, without the bias
    weights = tl.where(kmask, weights, 0.0)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(w_ptr + t * TOP_K + kk, weights * scaling_factor, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kmask)


def route(router_logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor | None = None,
          renormalize: bool = True, scaling_factor: float = 1.0) -> RouteResult:
    """noaux_tc routing (one group): ``router_logits`` fp32 [T, E] -> RouteResult(weights fp32 [T, k], ids int32 [T, k])."""
    tokens, num_experts = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids, num_experts,
            logits.stride(0), float(scaling_factor), TOP_K=top_k, HAS_BIAS=correction_bias is not None,
            RENORM=renormalize, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        )
    return RouteResult(weights, ids)


def act_and_mul_supports(x, *args) -> tuple[bool, str]:
    if x.dtype not in _FLOAT_DTYPES:
        return False, f"x must be bf16/fp16/fp32, got {x.dtype}"
    return True, "supported"


def route_supports(router_logits, top_k, *, correction_bias=None, renormalize=True, scaling_factor=1.0):
    if router_logits.shape[1] > _MAX_EXPERTS:
        return False, f"{router_logits.shape[1]} experts exceed the one-tile limit {_MAX_EXPERTS}"
    return True, "supported"


KERNELS = {
    "situ_and_mul": (situ_and_mul, act_and_mul_supports),
    "silu_and_mul": (silu_and_mul, act_and_mul_supports),
    "route": (route, route_supports),
}
