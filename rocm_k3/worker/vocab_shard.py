"""The vocabulary a rank samples over: the whole vocabulary (one rank) or its slice of a vocab-parallel LM head.

With tensor parallelism the LM head of TP rank ``r`` computes the logits of tokens ``[start, start + width)``
(``start = r * per_rank``, ``per_rank = ceil(vocab / tp)``) and the sampler never gathers the rows: every
reduction over the vocabulary goes through a :class:`VocabShard`, which combines per-rank statistics over the TP
group (a max with its first index, sums, top-k candidates, log-sum-exp). :meth:`VocabShard.whole` is the
one-rank shard: its methods are the plain torch reductions and issue no collective.

Every method is a collective on a sliced shard: all ranks of the group call the same methods in the same order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """vocab: the full vocabulary; start / width: this rank's tokens; per_rank: the slice stride (every rank's
    width <= per_rank); group: the TP group the slices are spread over (None: the whole vocabulary here);
    count(name, nbytes): called per collective issued (the rank's statistics), or None."""

    vocab: int
    start: int = 0
    width: int = 0
    per_rank: int = 0
    group: Any = None
    count: Callable[[str, int], None] | None = None

    def __post_init__(self) -> None:
        if self.vocab < 1 or not 0 < self.width <= self.per_rank or self.start + self.width > self.vocab:
            raise ValueError(f"vocab shard: tokens [{self.start}, {self.start + self.width}) of {self.vocab} with "
                             f"slices of {self.per_rank}: expected a non-empty slice inside the vocabulary")

    @classmethod
    def whole(cls, vocab: int) -> VocabShard:
        return cls(vocab, 0, vocab, vocab)

    @classmethod
    def of_rank(cls, vocab: int, rank: int, size: int, group: Any, count=None) -> VocabShard | None:
        """Rank ``rank``'s slice of ``size`` equal slices, or None when some rank's slice would be empty (a
        vocabulary smaller than ``(size - 1) * ceil(vocab / size)``)."""
        per_rank = math.ceil(vocab / size)
        if (size - 1) * per_rank >= vocab:
            return None
        start = rank * per_rank
        return cls(vocab, start, min(per_rank, vocab - start), per_rank, group, count)

    @property
    def is_whole(self) -> bool:
        return self.group is None

    # ---- collectives ---------------------------------------------------------------------------------------
    def _note(self, name: str, t: torch.Tensor) -> None:
        if self.count is not None:
            self.count(name, t.numel() * t.element_size())

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's ``t`` in rank order."""
        self._note("sampler_all_gather", t)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.is_whole:
            return t
        self._note("sampler_all_reduce", t)
        t = t.contiguous().clone()
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per row [N]: the sum over the group of this rank's ``x`` [N]."""
        return self._reduce(x, dist.ReduceOp.SUM)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.MAX)

    def flags_any(self, flags: torch.Tensor) -> torch.Tensor:
        """bool [N, F] -> whether any rank set each flag (one collective for several flags)."""
        return self._reduce(flags.to(torch.int32), dist.ReduceOp.MAX).bool()

    def argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [N], global token ids [N]) of the row maxima of ``x`` fp32 [N, width] (no NaN); ties go to the
        lowest token id, as ``argmax`` over the whole row."""
        top, idx = x.max(dim=-1)  # [N]
        if self.is_whole:
            return top, idx
        both = self._gather(torch.stack([top.double(), (idx + self.start).double()]))  # [size, 2, N]
        rank = both[:, 0].argmax(dim=0)  # [N] the first rank (lowest ids) holding the maximum
        pick = both.gather(0, rank[None, None, :].expand(1, 2, -1))[0]  # [2, N]
        return pick[0].to(x.dtype), pick[1].long()

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, global ids) [N, min(k, vocab)] of the ``k`` largest entries per row, largest first."""
        k = min(k, self.vocab)
        if self.is_whole:
            top = x.topk(k, dim=-1)
            return top.values, top.indices
        vals, ids = self.candidates(x, min(k, self.per_rank))
        return vals[:, :k], ids[:, :k]

    def candidates(self, x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``m`` largest entries per row (``m <= per_rank``), merged and sorted largest first:
        (values, global ids) [N, size * m]; a rank with fewer than ``m`` tokens pads with -inf (id ``vocab``)."""
        if self.is_whole:
            top = x.topk(min(m, self.width), dim=-1)
            return top.values, top.indices
        local = x.topk(min(m, self.width), dim=-1)
        n, got = local.values.shape
        vals = torch.full((n, m), float("-inf"), dtype=x.dtype, device=x.device)
        ids = torch.full((n, m), self.vocab, dtype=torch.float64, device=x.device)
        vals[:, :got] = local.values
        ids[:, :got] = (local.indices + self.start).double()
        both = self._gather(torch.stack([vals.double(), ids]))  # [size, 2, N, m]
        merged = both.permute(1, 2, 0, 3).reshape(2, n, -1)  # [2, N, size * m]
        order = merged[0].argsort(dim=-1, descending=True, stable=True)
        return merged[0].gather(1, order).to(x.dtype), merged[1].gather(1, order).long()

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part [N, width] of the softmax of the whole rows."""
        if self.is_whole:
            return torch.softmax(x, dim=-1)
        top = self.max(x.max(dim=-1).values)[:, None]  # [N, 1]
        e = torch.exp(x - top)
        return e / self.sum(e.sum(dim=-1))[:, None]

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part [N, width] of the log-softmax of the whole rows (one log-sum-exp over the group)."""
        if self.is_whole:
            return torch.log_softmax(x, dim=-1)
        top = self.max(x.max(dim=-1).values)[:, None]  # [N, 1]
        lse = top + torch.log(self.sum(torch.exp(x - top).sum(dim=-1)))[:, None]
        return x - lse

    def pick(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[N]: ``x[i, ids[i]]`` for global token ids ``ids`` [N] (the rank holding the token contributes it)."""
        local = ids - self.start
        mine = (local >= 0) & (local < self.width)  # [N]
        vals = x.gather(1, local.clamp(0, self.width - 1)[:, None])[:, 0]
        if self.is_whole:
            return vals
        return self.sum(torch.where(mine, vals, torch.zeros_like(vals)))

    def race(self, gen: torch.Generator, replicated: bool, device: torch.device) -> torch.Tensor:
        """Exp(1) noise for this rank's tokens [width]. ``replicated``: every rank holds the same generator (a
        seeded request) and draws the whole vocabulary's noise, keeping its slice, so the draw equals one
        rank's; otherwise each rank draws only its own slice from its own generator."""
        if self.is_whole or not replicated:
            return torch.empty(self.width, device=device).exponential_(generator=gen)
        return torch.empty(self.vocab, device=device).exponential_(generator=gen)[self.start : self.start + self.width]

    def scatter_local(self, ids: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """bool [N, width]: True at this rank's tokens among the global ``ids`` [N, C] whose ``flags`` [N, C] is set."""
        local = ids - self.start
        hit = flags & (local >= 0) & (local < self.width)
        out = torch.zeros(ids.shape[0], self.width + 1, dtype=torch.bool, device=ids.device)
        out.scatter_(1, torch.where(hit, local, torch.full_like(local, self.width)), hit)
        return out[:, : self.width]
