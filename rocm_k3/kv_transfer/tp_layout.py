"""Different tensor-parallel layouts on the two sides of a transfer.

The wire always carries the TP-1 layout, so a producer and a consumer never need to know each other's TP size:
- the MLA latent KV is replicated on every TP rank, so TP rank 0 alone publishes it and each consumer rank copies
  the one copy;
- each KDA layer's recurrent state ([H/tp, K, V] per slot) and short-conv state ([3 H/tp K, W-1] per slot, q | k
  | v of this rank's heads) are split by heads: a producer gathers the shards to rank 0, which merges them into
  the full-head layout ([H, K, V], [3 H K, W-1]); each consumer rank cuts its own heads out of that.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class TPShard:
    """This worker's place in its TP group: rank, size, and the gloo group over the TP ranks (None at size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} of size {self.size} is out of range")
        if self.size > 1 and self.group is None:
            raise ValueError(f"TP size {self.size} needs a process group")

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def _is_conv(name: str) -> bool:
    if name.endswith(".conv"):
        return True
    if name.endswith(".recurrent"):
        return False
    raise ValueError(f"{name!r} is not a KDA state name (kda.<i>.recurrent or kda.<i>.conv)")


def merge_heads(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The TP-1 layout of one slot's KDA state from the TP ranks' shards (rank order)."""
    if not _is_conv(name):
        return torch.cat(shards, dim=0)  # [H/tp, K, V] x tp -> [H, K, V]
    hist = shards[0].shape[-1]
    parts = [s.reshape(3, -1, hist) for s in shards]  # [3, H/tp K, W-1] each
    return torch.cat(parts, dim=1).reshape(-1, hist)  # [3 H K, W-1]: all q, then all k, then all v


def split_heads(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of one slot's KDA state in the TP-1 layout; ValueError if the heads do not divide."""
    if size == 1:
        return full
    conv = _is_conv(name)
    heads = full.shape[0] // 3 if conv else full.shape[0]
    if full.shape[0] % (3 if conv else 1) or heads % size:
        raise ValueError(f"{name!r}: {tuple(full.shape)} does not split over {size} tensor-parallel ranks")
    if not conv:
        return full.reshape(size, -1, *full.shape[1:])[rank].contiguous()  # [H/tp, K, V]
    hist = full.shape[-1]
    return full.reshape(3, size, -1, hist)[:, rank].reshape(-1, hist).contiguous()  # [3 H/tp K, W-1]


def gather_heads(name: str, local: torch.Tensor, tp: TPShard) -> torch.Tensor | None:
    """Collective over the TP group (every rank calls it): the TP-1 layout of ``local`` on rank 0, None elsewhere."""
    if tp.size == 1:
        return local
    import torch.distributed as dist

    local = local.detach().to("cpu").contiguous()
    shards = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(shards, local, group=tp.group)
    return merge_heads(name, shards) if tp.is_first else None


def agree_failed(failed: set[str], tp: TPShard) -> set[str]:
    """Collective: the union of every TP rank's failed loads (a load failed on one rank is recomputed on all)."""
    if tp.size == 1:
        return failed
    import torch.distributed as dist

    every: list[Any] = [None] * tp.size
    dist.all_gather_object(every, sorted(failed), group=tp.group)
    return set().union(*every)
