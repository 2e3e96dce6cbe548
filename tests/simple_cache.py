"""A simple cache for a few concurrent requests: contiguous MLA pages and one KDA slot per sequence.

Sequence ``s`` (0 <= s < max_seqs) owns MLA pages ``s * pages_per_seq ... (s + 1) * pages_per_seq - 1`` and
KDA slot ``s``; slots ``max_seqs ..`` are spare destinations for saved states (prefix caching tests). It
implements :class:`~rocm_k3.model.forward_batch.HybridCacheView` exactly like the engine's paged hybrid cache,
so the model cannot tell them apart; :meth:`SimpleCache.prepare` builds the ForwardBatch of one step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rocm_k3.worker.kv_pools import PoolShapes, KVPools
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch


class SimpleCache:
    """Per-request cache for generation (see module docstring).

    max_seqs: sequences held at once; max_model_len: tokens per sequence; spare_slots: extra KDA slots;
    dtype: MLA cache and conv state dtype (the model's); KDA recurrent state is always fp32.
    """

    def __init__(self, cfg: ModelConfig, *, max_seqs: int = 1, max_model_len: int, block_size: int = 16,
                 spare_slots: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_seqs", max_seqs), ("max_model_len", max_model_len), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if spare_slots < 0:
            raise ValueError(f"spare_slots: expected >= 0, got {spare_slots}")
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.pages_per_seq = math.ceil(max_model_len / block_size)
        self.device = torch.device(device)
        # the engine's tensor pools, laid out contiguously: pages of sequence s, then KDA slot s
        self._pools = KVPools(PoolShapes.from_model_config(cfg, dtype), block_size=block_size,
                                  num_blocks=max_seqs * self.pages_per_seq, num_slots=max_seqs + spare_slots,
                                  device=self.device)
        self.lengths = [0] * max_seqs  # tokens already cached per sequence

    # ------------------------------------------------------------------ HybridCacheView
    @property
    def block_size(self) -> int:
        return self._pools.block_size

    def mla_kv(self, mla_layer_idx: int) -> torch.Tensor:
        return self._pools.mla_kv(mla_layer_idx)

    def kda_state(self, kda_layer_idx: int) -> torch.Tensor:
        return self._pools.kda_state(kda_layer_idx)

    def conv_state(self, kda_layer_idx: int) -> torch.Tensor:
        return self._pools.conv_state(kda_layer_idx)

    # ------------------------------------------------------------------ bookkeeping
    def reset(self, seq: int) -> None:
        """Forget sequence ``seq`` (its KDA state is ignored from now on via has_initial_state=False)."""
        self._check_seq(seq)
        self.lengths[seq] = 0

    def prepare(self, steps: Sequence[tuple[int, Sequence[int]]],
                save: Sequence[tuple[int, int, int]] | None = None) -> ForwardBatch:
        """The ForwardBatch that appends ``new token ids`` to each ``(seq, ids)`` of ``steps``; advances lengths.

        save: optional rows ``(step row i, p, destination KDA slot)``: save the KDA states after the first p new
        tokens of row i into that slot. The returned batch must be run (lengths are already advanced).
        """
        if not steps:
            raise ValueError("steps: expected at least one (seq, token_ids) pair")
        ids, positions, slots, cu, seq_lens, rows, kda_slots, has_init = [], [], [], [0], [], [], [], []
        seen = set()
        for seq, tokens in steps:
            self._check_seq(seq)
            if seq in seen:
                raise ValueError(f"steps: sequence {seq} appears twice in one step")
            seen.add(seq)
            n, start = len(tokens), self.lengths[seq]
            if n == 0:
                raise ValueError(f"steps: sequence {seq} has no new tokens")
            if start + n > self.max_model_len:
                raise ValueError(
                    f"sequence {seq}: {start} cached + {n} new tokens exceed max_model_len={self.max_model_len}"
                )
            ids.extend(int(t) for t in tokens)
            pos = range(start, start + n)
            positions.extend(pos)
            first_page = seq * self.pages_per_seq
            slots.extend(first_page * self.block_size + p for p in pos)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            rows.append(list(range(first_page, first_page + self.pages_per_seq)))
            kda_slots.append(seq)
            has_init.append(start > 0)
        for seq, tokens in steps:
            self.lengths[seq] += len(tokens)
        dev = self.device

        def i32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        save_positions = save_slots = None
        if save:
            save_positions = i32([[i, p] for i, p, _ in save]).reshape(-1, 2)
            save_slots = i32([s for _, _, s in save])
        query_lens = [cu[i + 1] - cu[i] for i in range(len(steps))]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            cu_seqlens=i32(cu),
            seq_lens=i32(seq_lens),
            block_table=i32(rows),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            kda_slots=i32(kda_slots),
            has_initial_state=torch.tensor(has_init, dtype=torch.bool, device=dev),
            logits_indices=torch.tensor([c - 1 for c in cu[1:]], dtype=torch.int64, device=dev),
            save_positions=save_positions,
            save_slots=save_slots,
            is_decode=all(n == 1 for n in query_lens) and all(has_init),
        )

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.max_seqs:
            raise ValueError(f"seq: expected 0..{self.max_seqs - 1}, got {seq}")
