"""The ``comm`` op family: collectives over a process group, with torch.distributed as the reference.

- ``all_reduce(x, group) -> sum of x over the group`` (a new tensor; ``x`` is not modified);
- ``all_gather(x, group, dim=-1) -> the group's tensors concatenated along dim`` in rank order;
- ``reduce_scatter(x, group, dim=0) -> this rank's 1/n slice of the sum`` (dim divisible by the group size);
- ``all_to_all(x, group, in_splits=None, out_splits=None) -> rank r's r-th chunk of every rank, concatenated``
  (dim 0 split in n equal chunks, or in ``in_splits`` rows per peer, receiving ``out_splits`` rows from each:
  the expert-parallel dispatch).

``group`` None (the single-process layout) makes every op the identity. Backends may register fused or faster
versions (an all-reduce fused with the next RMSNorm, an EP dispatch/combine) with the same signatures; the
reference goes through torch.distributed ("nccl" = NCCL on NVIDIA and RCCL on ROCm, "gloo" on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rocm_k3.ops import registry

__all__ = ["REFERENCE_IMPLS", "all_gather", "all_reduce", "all_to_all", "reduce_scatter"]

for _op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
    registry.declare_op(_op)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _check(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def all_reduce_reference(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather_reference(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_reference(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    n = _size(group)
    chunks = [c.contiguous() for c in x.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    if x.device.type == "cpu":  # gloo has no reduce_scatter: all-reduce, then keep this rank's chunk
        return all_reduce_reference(x, group).chunk(n, dim=dim)[dist.get_rank(group)].contiguous()
    dist.reduce_scatter(out, chunks, group=group)
    return out


def all_to_all_reference(x: torch.Tensor, group, in_splits: list[int] | None = None,
                         out_splits: list[int] | None = None) -> torch.Tensor:
    if out_splits is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_reduce(x: torch.Tensor, group, *, backend=None) -> torch.Tensor:
    x = _check(x, "x")
    if _size(group) == 1:
        return x
    return registry.dispatch("all_reduce", backend, x, group)


def all_gather(x: torch.Tensor, group, dim: int = -1, *, backend=None) -> torch.Tensor:
    x = _check(x, "x")
    if _size(group) == 1:
        return x
    return registry.dispatch("all_gather", backend, x, group, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0, *, backend=None) -> torch.Tensor:
    x = _check(x, "x")
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    return registry.dispatch("reduce_scatter", backend, x, group, dim)


def all_to_all(x: torch.Tensor, group, *, in_splits: list[int] | None = None, out_splits: list[int] | None = None,
               backend=None) -> torch.Tensor:
    x = _check(x, "x")
    n = _size(group)
    if (in_splits is None) != (out_splits is None):
        raise ValueError("all_to_all: give both in_splits and out_splits, or neither")
    if in_splits is not None:
        if len(in_splits) != n or len(out_splits) != n:
            raise ValueError(f"all_to_all: in_splits / out_splits need one entry per rank of the group ({n}), got "
                             f"{len(in_splits)} / {len(out_splits)}")
        if sum(in_splits) != x.shape[0]:
            raise ValueError(f"all_to_all: in_splits sum to {sum(in_splits)}, x has {x.shape[0]} rows")
    if n == 1:
        return x
    if in_splits is None and x.shape[0] % n:
        raise ValueError(f"all_to_all: dim 0 of size {x.shape[0]} is not divisible by the group size {n}")
    if in_splits is None:
        return registry.dispatch("all_to_all", backend, x, group)
    return registry.dispatch("all_to_all", backend, x, group, in_splits, out_splits)


REFERENCE_IMPLS = {
    "all_reduce": all_reduce_reference,
    "all_gather": all_gather_reference,
    "reduce_scatter": reduce_scatter_reference,
    "all_to_all": all_to_all_reference,
}
