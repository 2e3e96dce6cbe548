"""How a parameter is filled from the checkpoint: each rank reads only its slice of each tensor.

A layer declares, per checkpoint tensor it needs, a :class:`Target`: the view of one of its parameters to fill
and a :class:`Read` (the whole tensor, or a narrow range along one dim, then an optional reshape). The loader
reads exactly that range through safetensors' ``get_slice`` (no other bytes leave the file), casts it to the
parameter's dtype and copies it in. Shard rules: replicated (whole), column (rows split by TP rank), row (input
columns split), expert (whole experts per EP rank, or each expert's intermediate dim split by TP rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Read:
    """One rank's read of one checkpoint tensor: all of it (``dim`` None) or ``[start, start + length)`` of
    ``dim``; ``transform`` (e.g. a squeeze, a flatten-and-narrow) runs on what was read."""

    dim: int | None = None
    start: int = 0
    length: int = 0
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slicing of a ``get_slice`` proxy (or a tensor) that reads this range."""
        if self.dim is None:
            return tuple(slice(None) for _ in range(ndim))
        dim = self.dim % ndim
        return tuple(slice(self.start, self.start + self.length) if i == dim else slice(None) for i in range(ndim))


@dataclasses.dataclass(frozen=True)
class Target:
    """Fill ``dst`` (a view of a parameter) from one checkpoint tensor read as ``read``."""

    dst: torch.Tensor
    read: Read = Read()


def column(rank: int, length: int, transform=None) -> Read:
    """Rows ``[rank * length, (rank + 1) * length)`` (output features of a column-parallel weight)."""
    return Read(0, rank * length, length, transform)


def row(rank: int, length: int) -> Read:
    """Input columns ``[rank * length, (rank + 1) * length)`` (a row-parallel weight)."""
    return Read(1, rank * length, length)


def new_param(shape: Iterable[int], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter (the loader fills it; training may unfreeze it)."""
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)


class WeightTargets(nn.Module):
    """Base of rocm-k3's layers: ``weight_targets()`` maps canonical checkpoint names to :class:`Target` s,
    gathered from the submodules; ``post_load()`` runs once every parameter is filled."""

    def own_targets(self) -> dict[str, Target]:
        return {}

    def weight_targets(self) -> dict[str, Target]:
        out: dict[str, Target] = {}
        for module in self.modules():
            if isinstance(module, WeightTargets):
                for name, target in module.own_targets().items():
                    if name in out:
                        raise ValueError(f"checkpoint tensor {name} is claimed by two parameters")
                    out[name] = target
        return out

    def post_load(self) -> None:
        for module in self.modules():
            if module is not self and isinstance(module, WeightTargets):
                module.finish_load()
        self.finish_load()

    def finish_load(self) -> None:
        """Per-module work after loading (re-layouts, derived views); default none."""
