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

The split sizes are exchanged first (an ``ep``-int all-to-all) and read on the host, so this path cannot be
captured in a decode graph. Decode steps take the static-capacity path instead (:func:`dispatch_static` /
:func:`combine_static`): every (source, destination) pair has a fixed ``capacity`` of rows, ``ceil(T / ep) x k``
(a rank's whole slice of picks, so no pick is ever dropped), and a pick's row in the ``[ep x capacity]`` send
buffer is its owner's block plus its rank among the picks for that owner (a running count in pick order, the
dynamic path's order). Rows, and a metadata tensor whose third column marks the rows that hold a pick (the counts,
in a fixed-size tensor), travel with equal-split all-to-alls, so the step's shapes depend only on T. Each rank
runs its ``ep x capacity`` received rows through its experts (rows without a pick: zero input, weight 0, dealt
round-robin over the experts real rows use, so they touch no extra weights and stack on no one expert, see
:func:`padding_experts`), and the combine reads back only the rows of real picks.
"""

from __future__ import annotations

import dataclasses
import math

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


@dataclasses.dataclass(frozen=True)
class StaticPlan:
    """Where this rank's picks went on the static-capacity path: ``slot`` [P] the row of each pick (in (token,
    slot) order) in the ``[ep x capacity]`` send buffer, which the combine's buffer mirrors."""

    slot: torch.Tensor  # [P] int64
    capacity: int
    tokens: int
    top_k: int


@dataclasses.dataclass(frozen=True)
class StaticDispatched:
    """The ``ep x capacity`` rows this rank runs: ``rows`` [ep C, width] (zero where no pick), ``weights`` fp32
    [ep C, 1] (0 where no pick), ``ids`` int32 [ep C, 1] local expert ids, ``valid`` bool [ep C] (a pick's row)."""

    rows: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    valid: torch.Tensor
    plan: StaticPlan


def static_capacity(tokens: int, ep: int, top_k: int) -> int:
    """Rows per (source, destination) pair for a step of ``tokens`` tokens: the largest slice's picks."""
    return math.ceil(tokens / ep) * top_k


def _a2a(x: torch.Tensor, ctx: ParallelContext, send: list[int] | None, recv: list[int] | None, table,
         what: str) -> torch.Tensor:
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


def dispatch_static(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int, capacity: int,
                    ctx: ParallelContext, table) -> StaticDispatched:
    """:func:`dispatch` with shapes fixed by ``capacity`` (>= this rank's ``T x k`` picks; see the module doc):
    nothing is read on the host, so a decode graph can hold it."""
    tokens, top_k = ids.shape
    ep, picks = ctx.ep_size, tokens * top_k
    if picks > capacity:
        raise ValueError(f"dispatch_static: {picks} picks exceed the capacity of {capacity} rows per rank pair")
    flat = ids.reshape(-1).to(torch.int64)  # [P]
    owner = flat // experts_per_rank  # [P]
    hits = owner[:, None] == torch.arange(ep, device=ids.device)[None, :]  # [P, ep]
    rank_in_owner = (hits.cumsum(0) - 1).gather(1, owner[:, None])[:, 0]  # [P] 0, 1, ... per owner, pick order
    slot = owner * capacity + rank_in_owner  # [P] rows in the [ep C] send buffer
    width = z.shape[1]
    rows = z.new_zeros((ep * capacity, width))  # [ep C, width]
    rows[slot] = z[:, None, :].expand(tokens, top_k, width).reshape(picks, width)  # pick p = (token p // k, p % k)
    meta = torch.zeros((ep * capacity, 3), dtype=torch.float32, device=z.device)  # [ep C, (local id, weight, valid)]
    meta[slot] = torch.stack([(flat - owner * experts_per_rank).to(torch.float32), weights.reshape(-1).float(),
                              torch.ones_like(flat, dtype=torch.float32)], dim=1)
    ctx.count("moe_dispatch_static")
    rows = _a2a(rows, ctx, None, None, table, "moe_dispatch")  # [ep C, width]: C rows from each source rank
    meta = _a2a(meta, ctx, None, None, table, "moe_dispatch_meta")  # [ep C, 3]
    valid = meta[:, 2] > 0  # [ep C]
    local = padding_experts(meta[:, 0].to(torch.int64), valid, experts_per_rank).to(torch.int32)  # [ep C]
    return StaticDispatched(rows, meta[:, 1:2].contiguous(), local[:, None].contiguous(), valid,
                            StaticPlan(slot, capacity, tokens, top_k))


def padding_experts(local: torch.Tensor, valid: torch.Tensor, experts: int) -> torch.Tensor:
    """``local`` [R] int64 expert ids of the received rows with the rows without a pick (``~valid``) dealt
    round-robin over the experts that real rows already use (expert 0 when none does): they read no extra
    weights and, spread, fill those experts' partly used row blocks in the grouped GEMM instead of stacking
    ``ep x C - R`` rows (most of them at decode) on one expert, each of its blocks a full read of its weights.
    On the device only (no host read: a decode graph holds it)."""
    used = torch.zeros(experts, dtype=torch.int64, device=local.device)  # [E_local] real rows per expert
    used.index_add_(0, torch.where(valid, local, 0), valid.to(torch.int64))
    hit = used > 0  # [E_local]
    n_used = hit.sum().clamp_min(1)  # [] (1 when no row is real: all go to expert 0)
    ranked = torch.zeros(experts + 1, dtype=torch.int64, device=local.device)  # [E_local + 1] the used experts in
    # order first; unused ones all write the spare last entry (no sort, nothing read on the host)
    ranked.scatter_(0, torch.where(hit, hit.cumsum(0) - 1, experts), torch.arange(experts, device=local.device))
    turn = (~valid).to(torch.int64).cumsum(0) - 1  # [R] each padding row's index among the padding rows
    return torch.where(valid, local, ranked[turn.remainder(n_used)])


def combine_static(out: torch.Tensor, plan: StaticPlan, ctx: ParallelContext, table) -> torch.Tensor:
    """:func:`combine` for :func:`dispatch_static`: ``out`` [ep C, width] (weighted) goes back to the source ranks
    with an equal-split all-to-all and each pick reads its row -> [T, width] in ``out``'s dtype."""
    back = _a2a(out, ctx, None, None, table, "moe_combine")  # [ep C, width] in the send buffer's layout
    picks = back[plan.slot]  # [P, width] in (token, slot) order; rows without a pick are never read
    width = out.shape[1]
    return picks.view(plan.tokens, plan.top_k, width).float().sum(dim=1).to(out.dtype)  # [T, width]
