"""Linear layers with tensor-parallel shard rules (each a ``y = x @ W^T`` over this rank's part of ``W``).

- :class:`ReplicatedLinear`: the whole weight on every rank.
- :class:`ColumnParallelLinear`: output features split by TP rank (``out / tp`` rows); no collective.
- :class:`RowParallelLinear`: input features split (``in / tp`` columns); the partial products are summed with
  an all-reduce (``reduce=False`` leaves them partial for a caller that fuses the reduction).
- :class:`MergedColumnParallelLinear`: several checkpoint weights stacked along the output dim (one GEMM reads
  the input once), each shard either split by TP rank or replicated (e.g. KDA's ``q|k|v|f_a|b|gate``, where
  ``f_a`` is replicated).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.layers.weights import Read, Target, WeightTargets, column, new_param, row
from rocm_k3.ops import comm


def all_reduce(x: torch.Tensor, ctx: ParallelContext, ops, what: str = "all_reduce") -> torch.Tensor:
    """Sum ``x`` over the TP group (identity without one), counted in ``ctx.stats``."""
    if ctx.tp_size == 1:
        return x
    ctx.count(what)
    ctx.add("collective_bytes", x.numel() * x.element_size())
    return comm.all_reduce(x, ctx.tp_group, backend=ops)


class ReplicatedLinear(WeightTargets):
    def __init__(self, in_features: int, out_features: int, name: str, *, dtype: torch.dtype, device: torch.device,
                 transform=None) -> None:
        super().__init__()
        self.name = name
        self.weight = new_param((out_features, in_features), dtype, device)  # [out, in]
        self._transform = transform

    def own_targets(self) -> dict[str, Target]:
        return {self.name: Target(self.weight, Read(transform=self._transform))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(WeightTargets):
    """``out_features`` split over the TP ranks (LayoutError when it does not divide)."""

    def __init__(self, in_features: int, out_features: int, name: str, ctx: ParallelContext, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.name = name
        self.rank = ctx.tp_rank
        _, self.local = ctx.shard(out_features, f"{name} output features")
        self.weight = new_param((self.local, in_features), dtype, device)  # [out / tp, in]

    def own_targets(self) -> dict[str, Target]:
        return {self.name: Target(self.weight, column(self.rank, self.local))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(WeightTargets):
    """``in_features`` split over the TP ranks; ``forward`` all-reduces unless ``reduce`` is False."""

    def __init__(self, in_features: int, out_features: int, name: str, ctx: ParallelContext, ops, *,
                 dtype: torch.dtype, device: torch.device, reduce: bool = True) -> None:
        super().__init__()
        self.name = name
        self.ctx, self.ops, self.reduce = ctx, ops, reduce
        _, self.local = ctx.shard(in_features, f"{name} input features")
        self.weight = new_param((out_features, self.local), dtype, device)  # [out, in / tp]

    def own_targets(self) -> dict[str, Target]:
        return {self.name: Target(self.weight, row(self.ctx.tp_rank, self.local))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y, self.ctx, self.ops) if self.reduce else y


@dataclasses.dataclass(frozen=True)
class Shard:
    """One weight of a merged linear: checkpoint ``name``, ``size`` output features in all, ``split`` by TP
    rank (else replicated), optional ``transform`` of what is read."""

    name: str
    size: int
    split: bool = True
    transform: object = None


class MergedColumnParallelLinear(WeightTargets):
    """Several weights stacked along the output dim; ``local_sizes`` are this rank's widths in shard order."""

    def __init__(self, in_features: int, shards: list[Shard], ctx: ParallelContext, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.shards = shards
        self.rank = ctx.tp_rank
        self.local_sizes = [ctx.shard(s.size, f"{s.name} output features")[1] if s.split else s.size for s in shards]
        self.weight = new_param((sum(self.local_sizes), in_features), dtype, device)  # [sum local, in]

    def own_targets(self) -> dict[str, Target]:
        out, offset = {}, 0
        for shard, local in zip(self.shards, self.local_sizes):
            read = column(self.rank, local, shard.transform) if shard.split else Read(transform=shard.transform)
            out[shard.name] = Target(self.weight[offset : offset + local], read)
            offset += local
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
