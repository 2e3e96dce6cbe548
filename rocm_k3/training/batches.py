"""Length-bucketed batches of training rows and the loss on their target tokens.

Rows of similar length are grouped so that ``rows x longest row <= max_tokens`` (a longer row goes alone); shorter rows are right-padded
(padding only follows real tokens, and every op is causal, so it changes nothing before it) and never targets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rocm_k3.model.decoder import KimiModel
from rocm_k3.training.corpus import Example
from rocm_k3.training.forward import forward_logits


class Batch(NamedTuple):
    input_ids: torch.Tensor  # int64 [B, L]
    target: torch.Tensor  # bool [B, L]: token t is a target (predicted from the tokens before it)

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.target.to(device))


class LossSum(NamedTuple):
    nll: torch.Tensor  # fp32 scalar: summed negative log-likelihood of the target tokens (nats)
    count: int  # target tokens


def make_batches(rows: Sequence[Example], max_tokens: int, rng: random.Random, pad_id: int) -> list[Batch]:
    """Batches of ``rows`` (each used once), in an order drawn from ``rng``; a row longer than ``max_tokens`` is
    a batch of its own."""
    if not rows:
        raise ValueError("rows: expected at least one training row")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
    order = sorted(rows, key=lambda r: (len(r.token_ids), rng.random()))
    groups: list[list[Example]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * len(row.token_ids) <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    rng.shuffle(groups)
    return [_collate(g, pad_id) for g in groups]


def _collate(rows: Sequence[Example], pad_id: int) -> Batch:
    length = max(len(r.token_ids) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    target = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.int64)
        target[i, :len(r.target)] = torch.tensor(r.target, dtype=torch.bool)
    target[:, 0] = False  # nothing predicts the first token
    return Batch(ids, target)


def target_loss(model: KimiModel, batch: Batch, expert_counts: dict[int, torch.Tensor] | None = None) -> LossSum:
    """Summed next-token NLL over the batch's target tokens (``model``: a training model)."""
    logits = forward_logits(model, batch.input_ids, expert_counts=expert_counts)  # [B, L, vocab]
    mask = batch.target[:, 1:]
    nll = F.cross_entropy(logits[:, :-1][mask], batch.input_ids[:, 1:][mask], reduction="sum")
    return LossSum(nll, int(mask.sum()))
