"""dist tier: expert-parallel dispatch and combine over gloo (two real ranks, one spawned process each).

Each rank holds half of the tiny K3's 8 MXFP4 experts; the routed experts of a batch, run through
:class:`RoutedExperts` with EP (token slice -> all-to-all dispatch -> local experts -> all-to-all combine) and the
caller's all-reduce, equal one process running all experts on all picks. On a balanced batch each rank runs
exactly ``T x k / 2`` rows (counted in ``ctx.stats``), never ``T x k``; a skewed batch still gives the right sum.
The static-capacity path of decode graphs (fixed ``ceil(T / 2) x k`` rows per rank pair, equal-split all-to-alls,
no host read) gives the dynamic path's outputs on the same batches, on an odd T (uneven slices) and on a batch whose
picks all go to one rank (a full capacity block); rows a decode graph pads with are left out of the expert load; the
received rows without a pick are dealt evenly over the experts real rows use (no extra weights, no one expert's
row blocks multiplied).

Data parallelism (two replicas of TP1, one EP group over both): each replica's tokens are its own, each rank still
runs ``T x k / 2`` of the ``T`` tokens of both replicas, and a replica with zero tokens serves the other's rows.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.expert_dispatch import dispatch_static, static_capacity
from rocm_k3.model.layers.linear import all_reduce
from rocm_k3.model.moe import ActQuant, RoutedExperts, activation_for
from rocm_k3.model.tiny import tiny_config
from rocm_k3.ops import comm, moe, quant

pytestmark = pytest.mark.dist
TOKENS = 64


def _experts(cfg: ModelConfig) -> moe.ExpertWeights:
    gen = torch.Generator().manual_seed(11)
    e, n, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_hidden_size
    w13 = torch.randn(e, 2 * n, k, generator=gen) / k**0.5
    w2 = torch.randn(e, k, n, generator=gen) / n**0.5
    return moe.ExpertWeights("mxfp4", *quant.quantize_mxfp4(w13), *quant.quantize_mxfp4(w2))


def _batches(cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """name -> (z [T, width], weights fp32 [T, k], ids int32 [T, k])."""
    gen = torch.Generator().manual_seed(12)
    e, top_k = cfg.num_experts, cfg.num_experts_per_token
    t = torch.arange(TOKENS)
    balanced = torch.stack([(t + 3 * j) % e for j in range(top_k)], dim=1)  # each slice half on each rank's experts
    skewed = torch.stack([torch.full_like(t, 1), torch.where(t % 4 == 0, t % 3 + 5, 2)], dim=1)  # 7 of 8 on rank 0
    out = {}
    for name, ids in (("balanced", balanced), ("skewed", skewed)):
        z = torch.randn(TOKENS, cfg.expert_hidden_size, generator=gen)
        w = torch.rand(TOKENS, top_k, generator=gen) + 0.1
        out[name] = (z, w / w.sum(-1, keepdim=True), ids.to(torch.int32))
    return out


def _one_rank(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every pick on rank 1's experts (4..7): rank 0 sends it a full ``ceil(T / 2) x k`` block."""
    gen = torch.Generator().manual_seed(13)
    t = torch.arange(TOKENS)
    ids = torch.stack([4 + t % 4, 4 + (t + 1) % 4], dim=1).to(torch.int32)
    w = torch.rand(TOKENS, cfg.num_experts_per_token, generator=gen) + 0.1
    return torch.randn(TOKENS, cfg.expert_hidden_size, generator=gen), w / w.sum(-1, keepdim=True), ids


def _slice(w: moe.ExpertWeights, first: int, count: int) -> moe.ExpertWeights:
    part = [None if x is None else x[first : first + count].contiguous() for x in (w.w13, w.w13_scale, w.w2,
                                                                                    w.w2_scale)]
    return moe.ExpertWeights(w.fmt, *part)


def _join(rank: int, port: int):
    """This rank in a two-rank gloo world; the group of both ranks."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    return dist.new_group([0, 1])


def _ep_experts(ctx: ParallelContext) -> tuple:
    """(config, this rank's EP experts holding their slice of the full weights, the full weights, activation,
    activation format)."""
    cfg = ModelConfig.from_hf_dict(tiny_config())
    experts = RoutedExperts(cfg, "mlp.", ctx, "reference", dtype=torch.float32, device=torch.device("cpu"))
    full = _experts(cfg)
    experts.weights = _slice(full, experts.first, experts.count)
    return cfg, experts, full, activation_for(cfg), ActQuant()


def _rank(rank: int, port: int, results) -> None:
    group = _join(rank, port)
    try:
        ctx = ParallelContext(rank=rank, world_size=2, tp_rank=rank, tp_size=2, ep_enabled=True, tp_group=group)
        cfg, experts, full, activation, act_quant = _ep_experts(ctx)
        out = {}
        for name, (z, w, ids) in _batches(cfg).items():
            ctx.stats.clear()
            got = all_reduce(experts(z, w, ids, activation, act_quant), ctx, "reference")
            want = moe.fused_moe(z, full, w, ids, activation=activation, backend="reference")
            out[name] = (float((got - want).abs().max() / want.abs().max()), dict(ctx.stats))
        for name, (z, w, ids) in {**_batches(cfg), "odd": tuple(t[:7] for t in _batches(cfg)["skewed"]),
                                  "one_rank": _one_rank(cfg)}.items():
            ctx.stats.clear()
            dynamic = experts(z, w, ids, activation, act_quant)
            dyn_stats = dict(ctx.stats)
            ctx.stats.clear()
            static = experts(z, w, ids, activation, act_quant, static=True)
            got = all_reduce(static, ctx, "reference")
            want = moe.fused_moe(z, full, w, ids, activation=activation, backend="reference")
            out["static_" + name] = (float((static - dynamic).abs().max() / dynamic.abs().max()),
                                     float((got - want).abs().max() / want.abs().max()), dict(ctx.stats), dyn_stats)
        for name, (z, w, ids) in (("balanced", _batches(cfg)["balanced"]), ("skewed", _batches(cfg)["skewed"]),
                                  ("one_rank", _one_rank(cfg))):  # where the rows without a pick run
            lo, hi = rank * TOKENS // 2, (rank + 1) * TOKENS // 2
            held = dispatch_static(z[lo:hi], w[lo:hi], ids[lo:hi], experts.count,
                                   static_capacity(TOKENS, 2, cfg.num_experts_per_token), ctx, "reference")
            local = held.ids[:, 0].long()
            out["padding_" + name] = (torch.bincount(local[held.valid], minlength=experts.count).tolist(),
                                      torch.bincount(local[~held.valid], minlength=experts.count).tolist())
        z, w, ids = _batches(cfg)["balanced"]  # a graph bucket's padding rows (counted False) are no expert load
        counted = torch.arange(TOKENS) % 3 != 0
        experts.load.zero_()
        experts(z, w, ids, activation, act_quant, static=True, counted=counted)
        want_load = torch.bincount(ids[counted].reshape(-1).long(), minlength=cfg.num_experts)
        out["counted_load"] = torch.equal(experts.load, want_load) and int(want_load.sum()) < ids.numel()
        try:  # more picks than the capacity: named, never dropped
            dispatch_static(torch.zeros(4, cfg.expert_hidden_size), torch.ones(4, 2),
                            torch.zeros(4, 2, dtype=torch.int32), experts.count, 7, ctx, "reference")
            out["over_capacity"] = ""
        except ValueError as e:
            out["over_capacity"] = str(e)
        # 2 redundant experts: 10 physical slots, the replicas' weights are their logical expert's
        ctx.num_redundant_experts = 2
        spread = RoutedExperts(cfg, "mlp.", ctx, "reference", dtype=torch.float32, device=torch.device("cpu"))
        mine = list(spread.slots[spread.first : spread.first + spread.count])
        spread.weights = moe.ExpertWeights(full.fmt, *(None if x is None else x[mine].contiguous()
                                                        for x in (full.w13, full.w13_scale, full.w2, full.w2_scale)))
        z, w, ids = _batches(cfg)["skewed"]
        got = all_reduce(spread(z, w, ids, activation, act_quant), ctx, "reference")
        want = moe.fused_moe(z, full, w, ids, activation=activation, backend="reference")
        out["redundant"] = (float((got - want).abs().max() / want.abs().max()), spread.slots)
        # the variable-size all-to-all names a bad split at the boundary
        try:
            comm.all_to_all(torch.zeros(3, 2), group, in_splits=[1, 1], out_splits=[1, 1])
            out["bad_splits"] = ""
        except ValueError as e:
            out["bad_splits"] = str(e)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _spawn(fn) -> dict:
    """Run ``fn(rank, port, results)`` on two spawned ranks; the ranks' results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(fn, args=(port, results), nprocs=2, join=True)
        return dict(results)


def test_ep2_dispatch_runs_half_the_rows_and_matches_one_process() -> None:
    results = _spawn(_rank)
    cfg = ModelConfig.from_hf_dict(tiny_config())
    picks = TOKENS * cfg.num_experts_per_token
    for rank, out in results.items():
        for name in ("balanced", "skewed"):
            err, stats = out[name]
            assert err < 1e-5, (rank, name, err)
            assert stats["moe_picks"] == picks, stats
            assert stats["moe_dispatch"] == stats["moe_combine"] == 1, stats
        rows = out["balanced"][1]["moe_rows"]
        assert abs(rows - picks / 2) <= 0.1 * picks / 2, (rank, rows, picks)  # T x k / 2, never T x k
        assert "in_splits sum to 2, x has 3 rows" in out["bad_splits"], out["bad_splits"]
        err, slots = out["redundant"]
        assert err < 1e-5 and len(slots) == 10 and sorted(set(slots)) == list(range(8)), (err, slots)
        for name in ("balanced", "skewed", "odd", "one_rank"):
            vs_dynamic, vs_one_process, stats, dyn_stats = out["static_" + name]
            assert vs_dynamic < 1e-6 and vs_one_process < 1e-5, (rank, name, vs_dynamic, vs_one_process)
            assert stats["moe_dispatch_static"] == stats["moe_combine"] == 1 and "moe_dispatch_counts" not in stats
            assert dyn_stats["moe_dispatch_counts"] == 1 and "moe_dispatch_static" not in dyn_stats
            tokens = 7 if name == "odd" else TOKENS
            assert stats["moe_capacity_rows"] == 2 * -(-tokens // 2) * cfg.num_experts_per_token, (name, stats)
        assert "8 picks exceed the capacity of 7 rows" in out["over_capacity"], out["over_capacity"]
        for name in ("balanced", "skewed", "one_rank"):  # the rows without a pick: on the experts real rows use,
            real, pad = out["padding_" + name]  # dealt evenly (never stacked on one expert: its blocks cost reads)
            used = [e for e, n in enumerate(real) if n] or [0]  # (none real: expert 0 takes them)
            assert sum(real) + sum(pad) == 2 * static_capacity(TOKENS, 2, cfg.num_experts_per_token), (name, out)
            assert all(pad[e] == 0 for e in range(len(pad)) if e not in used), (rank, name, real, pad)
            assert max(pad[e] for e in used) - min(pad[e] for e in used) <= 1, (rank, name, real, pad)
        assert out["counted_load"]
    skewed_rows = [out["skewed"][1]["moe_rows"] for out in results.values()]
    assert sum(skewed_rows) == picks and skewed_rows[0] != skewed_rows[1]  # every pick runs once, where it lives


def _dp_rank(rank: int, port: int, results) -> None:
    """Two DP replicas (TP1 each): rank r is replica r, the EP group spans both ranks."""
    group = _join(rank, port)
    try:
        ctx = ParallelContext(rank=rank, world_size=2, dp_rank=rank, dp_size=2, ep_enabled=True, dp_ep_group=group)
        cfg, experts, full, activation, act_quant = _ep_experts(ctx)
        z, w, ids = _batches(cfg)["balanced"]
        half = TOKENS // 2
        out = {"owned": (experts.first, experts.count)}
        for name, mine in (("balanced", slice(rank * half, (rank + 1) * half)),  # each replica half of the batch
                           ("idle", slice(0, TOKENS if rank == 0 else 0))):  # replica 1 has no token this step
            ctx.stats.clear()
            got = experts(z[mine], w[mine], ids[mine], activation, act_quant)  # TP1: no all-reduce
            want = moe.fused_moe(z[mine], full, w[mine], ids[mine], activation=activation, backend="reference")
            err = float((got - want).abs().max() / want.abs().max()) if want.numel() else float(got.numel())
            out[name] = (err, dict(ctx.stats))
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_dp2_replicas_share_one_ep_group() -> None:
    results = _spawn(_dp_rank)
    cfg = ModelConfig.from_hf_dict(tiny_config())
    picks = TOKENS * cfg.num_experts_per_token  # T x k over both replicas
    assert [results[r]["owned"] for r in (0, 1)] == [(0, 4), (4, 4)]  # E / (DP x TP) experts each
    for rank, out in results.items():
        for name in ("balanced", "idle"):
            err, stats = out[name]
            assert err < 1e-5, (rank, name, err)
            assert stats["moe_dispatch"] == stats["moe_combine"] == 1, stats  # the idle replica joins the collectives
        rows = out["balanced"][1]["moe_rows"]
        assert abs(rows - picks / 2) <= 0.1 * picks / 2, (rank, rows, picks)  # T x k / 2, never T x k
        assert out["balanced"][1]["moe_picks"] == picks / 2  # each replica routed its own half
    idle_rows = [results[r]["idle"][1]["moe_rows"] for r in (0, 1)]
    assert results[1]["idle"][1]["moe_picks"] == 0 and idle_rows[1] > 0, idle_rows  # zero tokens, rows served
    assert sum(idle_rows) == picks, idle_rows
