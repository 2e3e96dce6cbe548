"""Logical-to-physical expert placement for expert parallelism with redundant experts (vLLM's EPLB idea).

``E`` logical experts (the checkpoint's) become ``E + R`` physical expert slots, ``(E + R) / ep`` per EP rank:
every logical expert has one slot or more (its replicas hold the same weights), so a busy expert's rows can be
spread over several ranks. A placement is built from a per-layer load profile (picks per logical expert, as
recorded by the EP ranks, see ``RoutedExperts.load``):

1. replicas: each of the ``R`` extra slots goes to the expert with the highest load per replica so far (ties to
   the lower id), at most one replica per rank;
2. packing: replicas, heaviest first, go to the rank with the least load so far that has a free slot and does not
   already hold that expert (ties to the lower rank);
3. inside a rank the slots are ordered by logical id.

Without a profile every expert counts as equally loaded (and without redundant experts rank ``r`` holds the
contiguous experts ``[r E/ep, (r+1) E/ep)``). Redundant slots change no result: a pick of expert
``e`` runs on replica ``pick index mod replicas(e)``, whose weights equal ``e``'s.

A placement file is JSON: ``{"num_experts": E, "ep_size": ep, "num_redundant_experts": R, "layers": {"<layer>":
[logical id of each physical slot]}}`` (layers left out use the uniform placement).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from rocm_k3.distributed.context import LayoutError


def _int(name: str, v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise LayoutError(f"{name}: expected an int >= {low}, got {v!r}")
    return v


def balanced_slots(loads: Sequence[float], redundant: int, ep_size: int) -> tuple[int, ...]:
    """The logical expert of each of the ``len(loads) + redundant`` physical slots (see the module doc)."""
    e = len(loads)
    _int("num_experts", e, 1)
    _int("num_redundant_experts", redundant, 0)
    _int("ep_size", ep_size, 1)
    if (e + redundant) % ep_size:
        raise LayoutError(f"num_experts + num_redundant_experts = {e + redundant} does not split over the "
                          f"{ep_size} expert-parallel ranks")
    if any(not isinstance(x, (int, float)) or isinstance(x, bool) or x < 0 for x in loads):
        raise LayoutError("expert loads must be non-negative numbers")
    load = [float(x) for x in loads]
    copies = [1] * e
    if redundant > e * (ep_size - 1):
        raise LayoutError(f"num_redundant_experts={redundant}: at most {e * (ep_size - 1)} (each of the {e} experts "
                          f"on every one of the {ep_size} ranks at most once)")
    for _ in range(redundant):
        best = max((i for i in range(e) if copies[i] < ep_size), key=lambda i: (load[i] / copies[i], -i))
        copies[best] += 1
    replicas = sorted(((load[i] / copies[i], i) for i in range(e) for _ in range(copies[i])),
                      key=lambda r: (-r[0], r[1]))
    per_rank = (e + redundant) // ep_size
    held: list[list[int]] = [[] for _ in range(ep_size)]
    total = [0.0] * ep_size
    for share, expert in replicas:
        free = [r for r in range(ep_size) if len(held[r]) < per_rank and expert not in held[r]]
        if not free:
            raise LayoutError(f"expert {expert}'s {copies[expert]} replicas cannot sit on distinct ranks of "
                              f"{ep_size}: use fewer redundant experts")
        rank = min(free, key=lambda r: (total[r], r))
        held[rank].append(expert)
        total[rank] += share
    return tuple(x for rank in held for x in sorted(rank))


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Physical slots per layer (``layers[layer]`` = logical id of each slot); ``default`` for other layers."""

    num_experts: int
    ep_size: int
    num_redundant_experts: int
    layers: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        e = _int("num_experts", self.num_experts, 1)
        _int("ep_size", self.ep_size, 1)
        r = _int("num_redundant_experts", self.num_redundant_experts, 0)
        per_rank = (e + r) // self.ep_size
        for layer, slots in self.layers.items():
            if len(slots) != e + r or (e + r) % self.ep_size:
                raise LayoutError(f"expert placement layer {layer}: {len(slots)} slots, expected "
                                  f"num_experts + num_redundant_experts = {e + r} splitting over {self.ep_size} ranks")
            if sorted(set(slots)) != list(range(e)):
                raise LayoutError(f"expert placement layer {layer}: every expert 0..{e - 1} needs a slot, "
                                  f"and only those")
            for rank in range(self.ep_size):
                mine = slots[rank * per_rank : (rank + 1) * per_rank]
                if len(set(mine)) != len(mine):
                    raise LayoutError(f"expert placement layer {layer}: rank {rank} holds an expert twice")

    @classmethod
    def uniform(cls, num_experts: int, redundant: int, ep_size: int) -> ExpertPlacement:
        return cls(num_experts, ep_size, redundant)

    @classmethod
    def from_loads(cls, loads: Mapping[int, Sequence[float]], redundant: int, ep_size: int) -> ExpertPlacement:
        """A placement balancing each layer's recorded ``loads`` (picks per logical expert)."""
        sizes = {len(v) for v in loads.values()}
        if len(sizes) != 1:
            raise LayoutError(f"expert loads: every layer needs one load per expert, got lengths {sorted(sizes)}")
        return cls(sizes.pop(), ep_size, redundant,
                   {int(k): balanced_slots(v, redundant, ep_size) for k, v in sorted(loads.items())})

    def slots(self, layer: int) -> tuple[int, ...]:
        """Logical expert of each physical slot of ``layer``."""
        if layer in self.layers:
            return self.layers[layer]
        if not self.num_redundant_experts:
            return tuple(range(self.num_experts))  # contiguous ranges, as the checkpoint numbers them
        return balanced_slots([1.0] * self.num_experts, self.num_redundant_experts, self.ep_size)

    def to_json(self) -> str:
        return json.dumps({"num_experts": self.num_experts, "ep_size": self.ep_size,
                           "num_redundant_experts": self.num_redundant_experts,
                           "layers": {str(k): list(v) for k, v in sorted(self.layers.items())}}, indent=1)

    @classmethod
    def read(cls, path: str | Path) -> ExpertPlacement:
        try:
            raw = json.loads(Path(path).read_text())
            layers = {int(k): tuple(int(x) for x in v) for k, v in raw.get("layers", {}).items()}
            return cls(raw["num_experts"], raw["ep_size"], raw["num_redundant_experts"], layers)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"expert placement {path}: cannot read it ({type(exc).__name__}: {exc})") from exc
