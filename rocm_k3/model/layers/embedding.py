"""Vocabulary-parallel token embedding and LM head.

Rank ``r`` holds rows ``[r * P, (r + 1) * P)`` of the ``[vocab, hidden]`` table, ``P = ceil(vocab / tp)`` (the
last rank's rows past the vocabulary are zero). The embedding looks up the ids it owns, zeroes the others and
all-reduces; the LM head computes this rank's ``P`` logits per row and all-gathers them (then trims the padding),
so every rank of the TP group has the full fp32 logits, or (``gather_logits`` False, set by a worker that samples
vocab-parallel, see ``worker/vocab_shard.py``) returns only this rank's ``valid`` columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.layers.linear import all_reduce
from rocm_k3.model.layers.weights import Read, Target, WeightTargets, new_param
from rocm_k3.ops import comm


class VocabParallelEmbedding(WeightTargets):
    def __init__(self, vocab_size: int, hidden_size: int, name: str, ctx: ParallelContext, ops, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.name, self.ctx, self.ops = name, ctx, ops
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / ctx.tp_size)
        self.start = ctx.tp_rank * self.per_rank
        self.valid = max(0, min(self.per_rank, vocab_size - self.start))  # rows of real tokens on this rank
        self.weight = new_param((self.per_rank, hidden_size), dtype, device)  # [P, hidden]
        with torch.no_grad():
            self.weight[self.valid :].zero_()

    def own_targets(self) -> dict[str, Target]:
        return {self.name: Target(self.weight[: self.valid], Read(0, self.start, self.valid))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(ids, self.weight)  # [T, hidden]
        local = ids - self.start
        mine = (local >= 0) & (local < self.valid)  # [T]
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out, self.ctx, self.ops, "embedding_all_reduce")


class ParallelLMHead(WeightTargets):
    """Logits fp32 ``[N, vocab]`` on every TP rank, or this rank's slice ``[N, valid]`` of tokens ``[start,
    start + valid)`` when ``gather_logits`` is False. ``tied``: share the embedding's rows (tie_word_embeddings)."""

    def __init__(self, vocab_size: int, hidden_size: int, name: str, ctx: ParallelContext, ops, *,
                 dtype: torch.dtype, device: torch.device, tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.name, self.ctx, self.ops = name, ctx, ops
        self.vocab_size = vocab_size
        self.tied = tied
        self.gather_logits = True
        if tied is not None:
            self.per_rank, self.start, self.valid = tied.per_rank, tied.start, tied.valid
        else:
            self.per_rank = math.ceil(vocab_size / ctx.tp_size)
            self.start = ctx.tp_rank * self.per_rank
            self.valid = max(0, min(self.per_rank, vocab_size - self.start))
            self.weight = new_param((self.per_rank, hidden_size), dtype, device)  # [P, hidden]
            with torch.no_grad():
                self.weight[self.valid :].zero_()

    def own_targets(self) -> dict[str, Target]:
        if self.tied is not None:
            return {}
        return {self.name: Target(self.weight[: self.valid], Read(0, self.start, self.valid))}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied.weight if self.tied is not None else self.weight
        logits = F.linear(hidden, weight).float()  # [N, P]
        if self.ctx.tp_size == 1:
            return logits[:, : self.vocab_size]
        if not self.gather_logits:
            return logits[:, : self.valid]  # [N, valid] this rank's tokens
        self.ctx.count("lm_head_all_gather")
        self.ctx.add("collective_bytes", logits.numel() * logits.element_size() * self.ctx.tp_size)
        return comm.all_gather(logits, self.ctx.tp_group, dim=-1, backend=self.ops)[:, : self.vocab_size]
