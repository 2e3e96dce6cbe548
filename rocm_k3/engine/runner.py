"""Builds the per-step :class:`ForwardBatch` from the scheduler's decisions and runs the model on the cache."""

from __future__ import annotations

from typing import Protocol

import torch

from rocm_k3.cache.hybrid_cache import HybridCache
from rocm_k3.cache.manager import CacheManager
from rocm_k3.engine.scheduler import SchedulerOutput
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView


class StepModel(Protocol):
    def forward(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor: ...


class ModelRunner:
    """Owns the device tensors of a step: executes the step's copies, builds the batch, runs the model."""

    def __init__(self, model: StepModel, cache: HybridCache, manager: CacheManager) -> None:
        self.model = model
        self.cache = cache
        self.manager = manager
        self.device = cache.device

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        """The ForwardBatch of a scheduled step (sequences in ``out.scheduled`` order).

        Per sequence i with new tokens [start, end): positions start..end-1, slot_mapping from its block table,
        seq_lens end, has_initial_state start > 0, logits at its last new token, save rows (i, p - start).
        """
        if not out.scheduled:
            raise ValueError("build_batch: the step schedules no sequence")
        bs = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        tables: list[list[int]] = []
        kda_slots: list[int] = []
        saves: list[list[int]] = []
        save_slots: list[int] = []
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            table = self.manager.table(seq.seq_id)
            ids += seq.token_ids[item.start : item.end]
            span = range(item.start, item.end)
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            cu.append(cu[-1] + item.num_new_tokens)
            tables.append(table)
            kda_slots.append(self.manager.slot(seq.seq_id))
            for pos, slot in item.saves:
                saves.append([i, pos - item.start])
                save_slots.append(slot)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]  # [N, max_blocks]; padding is never read

        def i32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        def i64(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            input_ids=i64(ids),
            positions=i64(positions),
            cu_seqlens=i32(cu),
            seq_lens=i32([item.end for item in out.scheduled]),
            block_table=i32(padded),
            slot_mapping=i64(slots),
            kda_slots=i32(kda_slots),
            has_initial_state=torch.tensor(
                [item.start > 0 for item in out.scheduled], dtype=torch.bool, device=self.device
            ),
            logits_indices=i64([c - 1 for c in cu[1:]]),
            save_positions=i32(saves).reshape(-1, 2) if saves else None,
            save_slots=i32(save_slots) if saves else None,
            is_decode=out.is_decode,
        )

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step's copies, then the model; logits fp32 [N, vocab] in ``out.scheduled`` order."""
        self.cache.apply_copies(out.copies)
        return self.model.forward(self.build_batch(out), self.cache)
