"""Expert-parallel dispatch and combine: routed rows travel to the rank that owns their expert and come back.

With expert parallelism the E routed experts are split whole over the EP group (``E / ep`` consecutive experts
per rank; the TP ranks, or with data parallelism every replica's ranks: ``ctx.ep_group``). A step's ``T x k`` (token, slot) picks are grouped by owner rank (a stable sort, so the order is
deterministic), the rows of ``z`` they need are sent with one variable-size ``all_to_all`` (plus one for the
pick's local expert id and weight), each rank runs only the rows it received through its experts (``k = 1`` per
row, weighted there), and a second ``all_to_all`` returns the weighted rows to their home rank. There they are
put back in (token, slot) order and summed over the ``k`` slots in fp32: a fixed order, so the result is the
same for the same batch every time. The caller (:class:`rocm_k3.model.moe.RoutedExperts`) gives each rank a
``1 / tp`` slice of its replica's tokens, so the rows run per rank per step are about ``T x k / ep`` on a balanced
batch of ``T`` tokens over all replicas
(counted in ``ctx.stats["moe_rows"]``, beside ``ctx.stats["moe_picks"] = T x k``).

The split sizes are exchanged first (an ``ep``-int all-to-all) and read on the host, so this path is not
captured in decode graphs (the worker runs EP ranks eagerly).
"""

from __future__ import annotations

import dataclasses

import torch

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.ops import comm


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Where this rank's picks went: ``order`` [P] pick indices grouped by owner rank; ``send`` / ``recv`` rows
    per peer rank (``sum(send) = P = T x k``)."""

    order: torch.Tensor  # [P] int64
    send: list[int]
    recv: list[int]
    tokens: int
    top_k: int


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """The rows this rank runs: ``rows`` [R, width], ``weights`` fp32 [R, 1], ``ids`` int32 [R, 1] (local
    expert ids), and the plan that sends their outputs home."""

    rows: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    plan: DispatchPlan


def _a2a(x: torch.Tensor, ctx: ParallelContext, send: list[int], recv: list[int], table, what: str) -> torch.Tensor:
    ctx.count(what)
    ctx.add("collective_bytes", x.numel() * x.element_size())  # sent (including the rows kept on this rank)
    return comm.all_to_all(x, ctx.ep_group, in_splits=send, out_splits=recv, backend=table)


def dispatch(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int,
             ctx: ParallelContext, table) -> Dispatched:
    """Send each pick of ``ids`` [T, k] (global expert ids, int32) with its row of ``z`` [T, width] and its
    weight (fp32 [T, k]) to the rank owning the expert."""
    tokens, top_k = ids.shape
    ep = ctx.ep_size
    flat = ids.reshape(-1).to(torch.int64)  # [P] pick p = (token p // k, slot p % k)
    owner = flat // experts_per_rank  # [P]
    order = torch.argsort(owner, stable=True)  # [P] picks grouped by owner rank
    send_counts = torch.bincount(owner, minlength=ep)  # [ep]
    recv_counts = _a2a(send_counts, ctx, [1] * ep, [1] * ep, table, "moe_dispatch_counts")
    send, recv = send_counts.tolist(), recv_counts.tolist()  # the split sizes, read once on the host
    local_ids = (flat[order] - owner[order] * experts_per_rank).to(torch.int32)  # [P]
    meta = torch.stack([local_ids.to(torch.float32), weights.reshape(-1)[order].to(torch.float32)], dim=1)  # [P, 2]
    rows = _a2a(z[order // top_k].contiguous(), ctx, send, recv, table, "moe_dispatch")  # [R, width]
    meta = _a2a(meta, ctx, send, recv, table, "moe_dispatch_meta")  # [R, 2]
    return Dispatched(rows, meta[:, 1:].contiguous(), meta[:, :1].to(torch.int32),
                      DispatchPlan(order, send, recv, tokens, top_k))


def combine(out: torch.Tensor, plan: DispatchPlan, ctx: ParallelContext, table) -> torch.Tensor:
    """Return the weighted expert rows ``out`` [R, width] to their home ranks and sum each token's ``k`` slots
    (fp32, in slot order) -> [T, width] in ``out``'s dtype."""
    back = _a2a(out, ctx, plan.recv, plan.send, table, "moe_combine")  # [P, width] in dispatch order
    picks = torch.empty_like(back)
    picks[plan.order] = back  # [P, width] in (token, slot) order
    width = out.shape[1]
    return picks.view(plan.tokens, plan.top_k, width).float().sum(dim=1).to(out.dtype)  # [T, width]
