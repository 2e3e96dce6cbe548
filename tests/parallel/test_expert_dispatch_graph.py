"""cuda tier: the static-capacity expert-parallel dispatch inside a captured CUDA graph (one GPU, an EP group of one).

A routed-expert decode step of the tiny K3 (Triton router and MXFP4 MoE) on the static path (route -> dispatch at
``ceil(T / ep) x k`` rows per rank pair -> experts -> combine) is captured once per batch size and replayed on
new inputs: the replay equals the same step run eagerly bit for bit, and both match the dynamic path (the
host-sized all-to-all) and one ``fused_moe`` over every pick. With one rank the all-to-alls are the identity; the
scatter into the capacity buffer, the rows without a pick (a capacity with slack) and the gather back are the code
a multi-rank graph runs. The multi-rank path is checked against the dynamic one over gloo
(tests/parallel/test_expert_dispatch.py).
"""

from __future__ import annotations

import pytest
import torch

from rocm_k3 import ops
from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.expert_dispatch import combine, combine_static, dispatch, dispatch_static, static_capacity
from rocm_k3.model.moe import activation_for
from rocm_k3.model.tiny import tiny_config
from rocm_k3.ops import moe, quant
from rocm_k3.ops.registry import bind
from tests.helpers import assert_rel, poisoned_like, seeded

pytestmark = pytest.mark.cuda


def _setup(device: torch.device):
    cfg = ModelConfig.from_hf_dict(tiny_config())
    gen = seeded(21)
    e, n, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_hidden_size
    w13 = torch.randn(e, 2 * n, k, generator=gen) / k**0.5
    w2 = torch.randn(e, k, n, generator=gen) / n**0.5
    raw = moe.ExpertWeights("mxfp4", *(t.to(device) for t in (*quant.quantize_mxfp4(w13), *quant.quantize_mxfp4(w2))))
    table = bind(device, "triton")
    weights = ops.prepare_expert_weights(raw, backend=table)
    bias = (torch.randn(e, generator=gen) * 0.1).to(device)
    return cfg, table, weights, bias


def _inputs(cfg: ModelConfig, tokens: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = seeded(seed)
    z = torch.randn(tokens, cfg.expert_hidden_size, generator=gen).to(device, torch.bfloat16)  # [T, width]
    logits = torch.randn(tokens, cfg.num_experts, generator=gen).to(device)  # fp32 [T, E]
    return z, logits


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_static_dispatch_step_in_a_graph_replays_the_eager_step(tokens: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    cfg, table, weights, bias = _setup(device)
    ctx = ParallelContext(ep_enabled=True)  # an EP group of one rank: the all-to-alls are the identity
    top_k, act = cfg.num_experts_per_token, activation_for(cfg)
    capacity = static_capacity(tokens, ctx.ep_size, top_k) + 3 * top_k  # slack: rows without a pick run too

    def route(logits):
        return ops.route(logits, top_k, correction_bias=bias, renormalize=cfg.moe_renormalize,
                         scaling_factor=cfg.routed_scaling_factor, backend=table)

    def static_step(z, logits):
        r = route(logits)
        held = dispatch_static(z, r.weights, r.ids, cfg.num_experts, capacity, ctx, table)
        out = ops.fused_moe(held.rows, weights, held.weights, held.ids, activation=act, backend=table)
        return combine_static(out, held.plan, ctx, table)  # [T, width]

    def dynamic_step(z, logits):
        r = route(logits)
        sent = dispatch(z, r.weights, r.ids, cfg.num_experts, ctx, table)
        out = ops.fused_moe(sent.rows, weights, sent.weights, sent.ids, activation=act, backend=table)
        return combine(out, sent.plan, ctx, table)

    z_buf, logits_buf = _inputs(cfg, tokens, 1, device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: compile, settle the allocations
            static_step(z_buf, logits_buf)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = static_step(z_buf, logits_buf)
    for seed in (2, 3):  # new inputs into the captured buffers, the output poisoned before each replay
        z, logits = _inputs(cfg, tokens, seed, device)
        z_buf.copy_(z)
        logits_buf.copy_(logits)
        graphed.copy_(poisoned_like(graphed))
        graph.replay()
        torch.cuda.synchronize(device)
        eager = static_step(z, logits)
        assert torch.isfinite(graphed).all()
        assert torch.equal(graphed, eager), f"T={tokens} seed {seed}: the replay differs from the eager step"
        assert_rel(graphed, dynamic_step(z, logits), 1e-2, "static vs dynamic dispatch")
        r = route(logits)
        whole = ops.fused_moe(z, weights, r.weights, r.ids, activation=act, backend=table)
        assert_rel(graphed, whole, 2e-2, "static dispatch vs one fused_moe over every pick")
