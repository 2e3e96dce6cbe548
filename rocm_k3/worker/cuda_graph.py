"""Decode-step graph capture (``torch.cuda.CUDAGraph``; the same code records a HIP graph on ROCm).

One graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, 40, ... up to ``max_num_seqs``), all sharing one memory
pool and one set of persistent input buffers sized for the largest bucket. A decode-only step of ``n``
requests replays the smallest bucket ``B >= n``: its plan is copied into the first ``n`` rows of the buffers and
rows ``n .. B-1`` are padding that reads and writes only the pools' scratch block and slot (token 0 at
position 0, one cached token, slot mapping into the scratch block), so no request's cache is touched.
The graph's logits buffer ``[B, vocab]`` is sliced to the ``n`` real rows.

Buffer plumbing (bucketing, padding, reuse) is plain tensor code and is tested on the CPU through
:meth:`DecodeGraphs.fill`; capture and replay need a GPU. A bucket whose capture fails (an op that reads a value
back to the host, say) is dropped with a logged reason and its steps run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import Protocol

import numpy as np
import torch

from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView

log = logging.getLogger("rocm_k3.worker")


class StepModel(Protocol):
    def forward(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor: ...


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (which is always the last bucket)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: expected a positive int, got {max_num_seqs!r}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Persistent decode buffers and one captured graph per bucket (see the module docstring).

    width: the fixed block-table width (blocks of one max_model_len request).
    """

    def __init__(self, model: StepModel, pools: HybridCacheView, width: int, buckets: list[int]) -> None:
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets: expected increasing positive sizes, got {buckets}")
        self.model = model
        self.pools = pools
        self.buckets = list(buckets)
        self.width = width
        self.device = pools.device
        b, dev = buckets[-1], self.device
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(b, dtype=i64, device=dev)
        self.positions = torch.zeros(b, dtype=i64, device=dev)
        self.seq_lens = torch.ones(b, dtype=i32, device=dev)
        self.block_table = torch.full((b, width), pools.pad_block, dtype=i32, device=dev)
        self.slot_mapping = torch.full((b,), pools.pad_block * pools.block_size, dtype=i64, device=dev)
        self.kda_slots = torch.full((b,), pools.pad_slot, dtype=i32, device=dev)
        self.has_initial_state = torch.ones(b, dtype=torch.bool, device=dev)
        self.cu_seqlens = torch.arange(b + 1, dtype=i32, device=dev)
        self.logits_indices = torch.arange(b, dtype=i64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.replays = 0

    def batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch over the first ``size`` rows of the persistent buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], cu_seqlens=self.cu_seqlens[: size + 1],
            seq_lens=self.seq_lens[:size], block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size],
            kda_slots=self.kda_slots[:size], has_initial_state=self.has_initial_state[:size],
            logits_indices=self.logits_indices[:size], is_decode=True,
        )

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows, or None when ``n`` exceeds the largest."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def fill(self, plan, bucket: int) -> None:
        """Copy a decode plan of ``n <= bucket`` rows into the buffers; rows ``n .. bucket-1`` become padding."""
        n = plan.input_ids.shape[0]
        if n > bucket:
            raise ValueError(f"fill: {n} rows do not fit bucket {bucket}")
        used = plan.block_table.shape[1]
        if used > self.width:
            raise ValueError(f"fill: block table of {used} columns exceeds the graph width {self.width}")

        def put(buf: torch.Tensor, values: np.ndarray, pad: int) -> None:
            buf[:n].copy_(torch.from_numpy(np.ascontiguousarray(values)), non_blocking=True)
            buf[n:bucket].fill_(pad)

        pools = self.pools
        put(self.input_ids, plan.input_ids, 0)
        put(self.positions, plan.positions, 0)
        put(self.seq_lens, plan.seq_lens, 1)
        put(self.slot_mapping, plan.slot_mapping, pools.pad_block * pools.block_size)
        put(self.kda_slots, plan.kda_slots, pools.pad_slot)
        self.block_table[:n, :used].copy_(torch.from_numpy(np.ascontiguousarray(plan.block_table)), non_blocking=True)
        self.block_table[n:bucket, 0].fill_(pools.pad_block)  # columns past a row's blocks are never read

    # ---- GPU ------------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first (the pool is sized by the first capture); failures fall back."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.buckets):
            batch = self.batch(size)
            try:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up: compile kernels, settle allocations outside the graph
                        self.model.forward(batch, self.pools)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.forward(batch, self.pools)
            except Exception as exc:  # an op that cannot be captured: this bucket runs eagerly
                log.warning("decode graph for batch size %d not captured (%s: %s); that size runs eagerly",
                            size, type(exc).__name__, exc)
                continue
            self._graphs[size] = graph
            self._logits[size] = logits
        torch.cuda.synchronize(self.device)
        log.info("captured decode graphs for batch sizes %s", sorted(self._graphs))

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def run(self, plan) -> torch.Tensor | None:
        """Replay the bucket of a decode plan; logits fp32 [n, vocab], or None when no graph fits."""
        n = plan.input_ids.shape[0]
        bucket = self.bucket_for(n)
        while bucket is not None and bucket not in self._graphs:
            bucket = self.bucket_for(bucket + 1)
        if bucket is None:
            return None
        self.fill(plan, bucket)
        self._graphs[bucket].replay()
        self.replays += 1
        return self._logits[bucket][:n]
