"""PyTorch references of the ``moe`` op family (fp32 math inside); validation happens in :mod:`rocm_k3.ops.moe`.

``fused_moe_reference`` groups the (token, slot) pairs by expert with a stable argsort of the ids, dequantises
each used expert once (from any layout: a prepared one is undone expert by expert), runs the two GEMMs in fp32
over bounded token chunks and scatter-adds the weighted results, so memory stays at one dequantised expert plus
a chunk of activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rocm_k3.ops.moe_types import DEFAULT_ACTIVATION, ExpertWeights, MoEActivation, RouteResult
from rocm_k3.quant.mxfp4 import dequantize_mxfp4_reference
from rocm_k3.quant.mxfp8 import dequantize_mxfp8_reference, quantize_mxfp8_reference

_CHUNK_ELEMENTS = 1 << 22  # fp32 elements per activation chunk inside one expert


def situ_and_mul_reference(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """``x [..., 2N]`` -> ``[..., N]`` (x dtype): ``beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb) or u)`` in fp32."""
    n = x.shape[-1] // 2
    gate = x[..., :n].to(torch.float32)
    up = x[..., n:].to(torch.float32)
    up_term = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up_term).to(x.dtype)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2N]`` -> ``[..., N]`` (x dtype): ``silu(gate) * up`` in fp32."""
    n = x.shape[-1] // 2
    return (F.silu(x[..., :n].to(torch.float32)) * x[..., n:].to(torch.float32)).to(x.dtype)


def route_reference(router_logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor | None = None,
                    renormalize: bool = True, scaling_factor: float = 1.0) -> RouteResult:
    """noaux_tc routing with one group: top-k of ``sigmoid(logits) + bias``; weights from ``sigmoid(logits)``.

    Ties in ``s + bias`` go to the lower expert index (stable sort); ids are ordered by descending score.
    """
    scores = torch.sigmoid(router_logits.to(torch.float32))  # [T, E]
    select = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    ids = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k] int64
    weights = scores.gather(1, ids)  # [T, k] the bias only selects
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return RouteResult(weights * scaling_factor, ids.to(torch.int32))


def _activate(h: torch.Tensor, activation: MoEActivation) -> torch.Tensor:
    """fp32 [c, 2N] -> fp32 [c, N] through the configured activation-and-multiply."""
    if activation.kind == "situ":
        return situ_and_mul_reference(h, activation.beta, activation.linear_beta)
    return silu_and_mul_reference(h)


def _mxfp8_round_trip(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 [..., K] -> fp32 [..., K] after MXFP8 quantisation (ct rule) and dequantisation."""
    q, scales = quantize_mxfp8_reference(t, fp8_dtype, "ct")
    return dequantize_mxfp8_reference(q, scales, torch.float32)


def _expert_fp32(weights: ExpertWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised weights of expert ``e``: (w13 fp32 [2N, K], w2 fp32 [Kout, N]), from any layout."""
    w13, s13, w2, s2 = weights.checkpoint_expert(e)
    if weights.fmt == "mxfp4":
        return (dequantize_mxfp4_reference(w13, s13, torch.float32),
                dequantize_mxfp4_reference(w2, s2, torch.float32))
    return w13.to(torch.float32), w2.to(torch.float32)


def fused_moe_reference(x: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                        activation: MoEActivation = DEFAULT_ACTIVATION, act_quant: str = "bf16",
                        fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * W2_e act(W13_e x_t)``, ``e = topk_ids[t, j]``; fp32 inside, x dtype out.

    act_quant "mxfp8" (A8W4): x and the activation output are MXFP8 round-tripped (ct rule, ``fp8_dtype``)
    before their GEMMs. Pairs are grouped by expert so each used expert is dequantised once.
    """
    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens, weights.out_features, dtype=torch.float32, device=x.device)  # [T, Kout]
    if tokens == 0:
        return out.to(x.dtype)
    quant_acts = act_quant == "mxfp8"
    xa = _mxfp8_round_trip(x, fp8_dtype) if quant_acts else x.to(torch.float32)  # [T, K] fp32
    flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [T*k] pair p = (token p // k, slot p % k)
    flat_weights = topk_weights.reshape(-1).to(torch.float32)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # [T*k] pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=weights.num_experts).tolist()
    chunk = max(1, _CHUNK_ELEMENTS // max(2 * weights.intermediate, weights.out_features, weights.hidden))
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]  # [c] pair indices routed to this expert
        start += count
        w13, w2 = _expert_fp32(weights, expert)  # [2N, K], [Kout, N]
        for c0 in range(0, count, chunk):
            chunk_pairs = pairs[c0 : c0 + chunk]
            token_idx = chunk_pairs // top_k  # [c]
            act = _activate(xa[token_idx] @ w13.T, activation)  # [c, 2N] -> [c, N]
            if quant_acts:
                act = _mxfp8_round_trip(act, fp8_dtype)
            y = (act @ w2.T) * flat_weights[chunk_pairs].unsqueeze(1)  # [c, Kout]
            out.index_add_(0, token_idx, y)
    return out.to(x.dtype)
