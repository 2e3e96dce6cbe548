"""Decode-step graph capture (``torch.cuda.CUDAGraph``; the same code records a HIP graph on ROCm).

One graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, 40, ... up to ``max_num_seqs``), all sharing one memory
pool and one set of persistent input buffers sized for the largest bucket. A decode-only step of ``n``
requests replays the smallest bucket ``B >= n``: its plan is copied into the first ``n`` rows of the buffers and
rows ``n .. B-1`` are padding that reads and writes only the pools' scratch block and slot (token 0 at
position 0, one cached token, slot mapping into the scratch block), so no request's cache is touched.
The graph's logits buffer ``[B, vocab]`` is sliced to the ``n`` real rows.

Speculative verification (``max_drafts`` k > 0) adds one graph per (batch bucket, w) for every width
w = 1 + d, d = 1 .. k: a verification of ``n <= B`` sequences with at most d drafts each runs in decode shape,
B * w rows (:mod:`~rocm_k3.worker.decode_layout`, the layout eager verifications use too). The logits rows
the step asks for are gathered from the ``[B * w, vocab]`` buffer, and when the model taps hidden states for a
drafter (``tap_layers``) the graph's tapped buffer is gathered the same way into ``taps.tapped``.

Pipeline parallelism: each stage captures only its own layers (:meth:`~rocm_k3.worker.stage_link.StageLink.run`).
The first stage's graph starts from the token ids; a later stage's graph reads the previous stage's state from
fixed input buffers (:class:`~rocm_k3.worker.stage_link.StateBuffers`, the bucket's rows: padding included); a
stage before the last ends in its output state, the last in the logits as without pipelining. The receive into
the input buffers and the send of the output (a copy: the next replay rewrites it) stay outside the graph
(:meth:`DecodeGraphs.replay`). Every stage of a step must pick the same (bucket, width), so after capture the
ranks keep only the shapes all of them captured (:meth:`DecodeGraphs.agree`; this also keeps TP ranks, whose
collectives must match, on one shape).

Buffer plumbing (bucketing, padding, reuse, a stage's fixed inputs) is plain tensor code and is tested on the
CPU through :meth:`DecodeGraphs.fill` (and the padded batches run eagerly there, through
:meth:`DecodeGraphs.replay` with :meth:`DecodeGraphs._record` overridden by a test); capture and replay need a
GPU. A bucket whose capture fails (an op that reads a value back to the host, say) is dropped with a logged reason
and its steps run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import Protocol

import numpy as np
import torch

from rocm_k3.distributed.groups import reduce_ints
from rocm_k3.model.attn_res import StackState
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.worker.decode_layout import decode_layout, save_rows
from rocm_k3.worker.stage_link import StateBuffers

log = logging.getLogger("rocm_k3.worker")


class StageModel(Protocol):
    """What the graphs capture and replay around (:class:`~rocm_k3.worker.stage_link.StageLink`)."""

    def run(self, batch: ForwardBatch, cache: HybridCacheView,
            state: StackState | None) -> torch.Tensor | StackState: ...

    def input_buffers(self, max_tokens: int) -> StateBuffers | None: ...

    def recv_into(self, state: StackState) -> None: ...

    def send(self, state: StackState, copy: bool = False) -> None: ...


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (which is always the last bucket)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: expected a positive int, got {max_num_seqs!r}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Persistent decode buffers and one captured graph per (bucket, width) (see the module docstring).

    model: the stage (None: buffers and layout only, nothing to capture); width: the fixed block-table width
    (blocks of one max_model_len request); max_drafts: the most drafts a verification holds
    (num_speculative_tokens; 0 without speculation); taps: the model whose ``tap_layers`` / ``tapped`` feed a
    drafter (None: nothing tapped).
    """

    def __init__(self, model: StageModel | None, pools: HybridCacheView, width: int, buckets: list[int],
                 max_drafts: int = 0, taps=None) -> None:
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets: expected increasing positive sizes, got {buckets}")
        if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or max_drafts < 0:
            raise ValueError(f"max_drafts: expected an int >= 0, got {max_drafts!r}")
        self.model = model
        self.pools = pools
        self.buckets = list(buckets)
        self.widths = list(range(1, max_drafts + 2))  # tokens per sequence: 1 + drafts
        self.width = width
        self.taps = taps
        self.device = pools.device
        b, dev = buckets[-1] * self.widths[-1], self.device
        i32, i64 = torch.int32, torch.int64
        self._stage(b, width, buckets[-1] * max_drafts, pools)  # input_ids ... block_table (what fill writes)
        self.has_initial_state = torch.ones(b, dtype=torch.bool, device=dev)
        self.cu_seqlens = torch.arange(b + 1, dtype=i32, device=dev)
        self.logits_indices = torch.arange(b, dtype=i64, device=dev)
        # a later pipeline stage's fixed input state (None on a first stage, and without a model)
        self.inputs: StateBuffers | None = None if model is None else model.input_buffers(b)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._out: dict[tuple[int, int], torch.Tensor | StackState] = {}  # logits, or the state to send on
        self._pool = self._stream = None
        self._tapped: dict[tuple[int, int], torch.Tensor | None] = {}
        self.replays = 0
        self.verify_replays = 0

    def _stage(self, rows: int, width: int, saves: int, pools: HybridCacheView) -> None:
        """The buffers :meth:`fill` writes, packed in one device byte buffer (8-byte aligned, the block table last)
        with a host mirror, pinned on a GPU: a step's plan is written into the mirror and crosses in one copy of the
        small buffers plus the block-table rows it uses (six pageable copies cost ~0.2 ms of host time a step on
        the H200, during which the GPU waits: benchmarks/RESULTS.md). Mirror and device buffers hold the same
        values at all times; the mirror is rewritten only once its last copy has left it (``_copied``)."""
        i32, i64 = torch.int32, torch.int64
        specs = [("input_ids", i64, (rows,), 0), ("positions", i64, (rows,), 0),
                 ("slot_mapping", i64, (rows,), pools.pad_block * pools.block_size), ("seq_lens", i32, (rows,), 1),
                 ("kda_slots", i32, (rows,), pools.pad_slot), ("save_slots", i32, (saves,), pools.pad_slot),
                 ("block_table", i32, (rows, width), pools.pad_block)]
        spans, at = {}, 0
        for name, dtype, shape, _ in specs:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            spans[name], at = (at, size), at + -(-size // 8) * 8
        on_gpu = self.device.type == "cuda"
        self._host = torch.empty(at, dtype=torch.uint8, pin_memory=on_gpu)  # [bytes]
        self._packed = torch.empty(at, dtype=torch.uint8, device=self.device)  # [bytes]
        self._mirror: dict[str, np.ndarray] = {}
        for name, dtype, shape, init in specs:
            start, size = spans[name]
            host = self._host[start : start + size].view(dtype).view(shape)
            host.fill_(init)
            self._mirror[name] = host.numpy()
            setattr(self, name, self._packed[start : start + size].view(dtype).view(shape))
        self._packed.copy_(self._host)
        self._table_at = spans["block_table"][0]
        self._copied = torch.cuda.Event() if on_gpu else None

    def batch(self, size: int, w: int = 1) -> ForwardBatch:
        """The ForwardBatch over the first ``size`` groups of ``w`` rows of the persistent buffers."""
        rows = size * w
        saves = {}
        if w > 1:  # the fixed save layout, slots from save_slots
            saves = {"save_positions": save_rows(size, w, self.device), "save_slots": self.save_slots[: size * (w - 1)]}
        return ForwardBatch(
            input_ids=self.input_ids[:rows], positions=self.positions[:rows], cu_seqlens=self.cu_seqlens[: rows + 1],
            seq_lens=self.seq_lens[:rows], block_table=self.block_table[:rows], slot_mapping=self.slot_mapping[:rows],
            kda_slots=self.kda_slots[:rows], has_initial_state=self.has_initial_state[:rows],
            logits_indices=self.logits_indices[:rows], is_decode=True, decode_width=w, graphed=True, **saves,
        )

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows, or None when ``n`` exceeds the largest."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def fill(self, plan, bucket: int, w: int = 1) -> np.ndarray:
        """Copy a plan of ``n <= bucket`` sequences with at most ``w`` new tokens each (all with an initial state)
        into the buffers in the (bucket, w) layout (:func:`~rocm_k3.worker.decode_layout.decode_layout`). Returns
        the rows holding the plan's ``logits_indices`` (int64)."""
        used = plan.block_table.shape[1]
        if used > self.width:
            raise ValueError(f"fill: block table of {used} columns exceeds the graph width {self.width}")
        pools = self.pools
        rows = bucket * w
        if self._copied is not None:
            self._copied.synchronize()  # the last fill's copy has left the mirror
        mirror = self._mirror
        # written into the mirror's first ``rows`` rows (the block table's first ``used`` columns)
        lay = decode_layout(plan, bucket, w, pad_block=pools.pad_block, block_size=pools.block_size,
                            pad_slot=pools.pad_slot, out=mirror)
        if lay.save_slots is not None:
            mirror["save_slots"][: lay.save_slots.shape[0]] = lay.save_slots
        end = self._table_at + rows * self.width * 4  # the small buffers whole, the block table's first rows
        self._packed[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return lay.rows

    # ---- GPU ------------------------------------------------------------------------------------------------
    def keys(self) -> list[tuple[int, int]]:
        """Every (bucket, width) this object may capture, most rows first."""
        return sorted(((b, w) for b in self.buckets for w in self.widths), key=lambda k: (-k[0] * k[1], k))

    def stage_input(self, key: tuple[int, int]) -> StackState | None:
        """The fixed input state the graph of ``key`` reads (a later pipeline stage), else None."""
        return None if self.inputs is None else self.inputs.view(key[0] * key[1])

    def capture(self) -> None:
        """Capture every (bucket, width), most rows first (the pool is sized by the first capture); failures fall
        back to eager steps."""
        for size, w in self.keys():
            try:
                graph, out = self._record(self.batch(size, w), self.stage_input((size, w)))
            except Exception as exc:  # an op that cannot be captured: this shape runs eagerly
                log.warning("decode graph for batch size %d x %d tokens not captured (%s: %s); that shape runs "
                            "eagerly", size, w, type(exc).__name__, exc)
                continue
            self._graphs[(size, w)] = graph
            self._out[(size, w)] = out
            self._tapped[(size, w)] = self.taps.tapped if self.taps is not None and self.taps.tap_layers else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("captured decode graphs for (batch size, tokens per sequence) %s", sorted(self._graphs))

    def _record(self, batch: ForwardBatch, state: StackState | None):
        """Warm up and capture the stage over ``batch`` (and the fixed input ``state``): (graph, its output)."""
        if self._pool is None:  # one memory pool and capture stream for all of this object's graphs
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: compile kernels, settle allocations outside the graph
                self.model.run(batch, self.pools, state)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model.run(batch, self.pools, state)
        return graph, out

    def agree(self, group) -> None:
        """Keep only the shapes every rank of ``group`` captured (a collective: every rank calls it; None: one
        rank): the stages of a step, and the TP ranks of a stage, must replay the same shape."""
        keys = self.keys()
        kept = reduce_ints([int(k in self._graphs) for k in keys], group, "min")
        dropped = [k for k, keep in zip(keys, kept) if not keep and k in self._graphs]
        for k in dropped:
            del self._graphs[k], self._out[k], self._tapped[k]
        if dropped:
            log.warning("decode graphs %s dropped: another rank could not capture them (those shapes run eagerly)",
                        dropped)

    @property
    def captured_keys(self) -> list[tuple[int, int]]:
        """Every captured (bucket, width)."""
        return sorted(self._graphs)

    @property
    def captured(self) -> list[int]:
        """Batch sizes with a captured one-token decode graph."""
        return sorted(b for b, w in self._graphs if w == 1)

    def launch(self, key: tuple[int, int]) -> torch.Tensor | StackState:
        """Replay the graph of ``key`` over the filled buffers (and the stage's input buffers), no communication:
        its output (logits [rows, vocab], or a stage's state to send on; rewritten by the next launch)."""
        self._graphs[key].replay()
        return self._out[key]

    def replay(self, key: tuple[int, int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step over the filled buffers: receive the input state (a later stage), launch, send the output on (a
        stage before the last). Returns (logits [rows, vocab], tapped [rows, taps, hidden] or None); (None, None)
        on a stage before the last."""
        state = self.stage_input(key)
        if state is not None:
            self.model.recv_into(state)
        out = self.launch(key)
        if isinstance(out, StackState):
            self.model.send(out, copy=True)
            return None, None
        return out, self._tapped[key]

    def key_for(self, n: int, w_min: int = 1) -> tuple[int, int] | None:
        """The captured (bucket, w) with the fewest rows that holds ``n`` sequences of ``w_min`` tokens."""
        fits = [k for k in self._graphs if k[0] >= n and k[1] >= w_min]
        return min(fits, key=lambda k: (k[0] * k[1], k)) if fits else None

    def run(self, plan, key: tuple[int, int], patch=None) -> torch.Tensor | None:
        """Replay ``key`` (from :meth:`key_for`) over a plan (a decode, or a verification of at most ``key[1]``
        tokens per sequence): logits fp32 [logits rows, vocab], or None on a pipeline stage before the last.
        patch: ``(input_ids, first_rows)`` -> None, called after the fill with the device buffer and the row of
        each sequence's first token (asynchronous scheduling writes the previous step's tokens there; the next
        fill rewrites those rows)."""
        rows = self.fill(plan, *key)
        if patch is not None:
            patch(self.input_ids, np.arange(plan.seq_lens.shape[0], dtype=np.int64) * key[1])
        logits, tapped = self.replay(key)
        self.replays += 1
        self.verify_replays += key[1] > 1
        if logits is None:
            return None
        plain = rows.shape[0] == plan.seq_lens.shape[0] and bool((rows == np.arange(rows.shape[0])).all())
        index = None if plain else torch.from_numpy(rows).to(self.device, non_blocking=True)
        if tapped is not None:
            self.taps.tapped = tapped[: rows.shape[0]] if plain else tapped[index]
        return logits[: rows.shape[0]] if plain else logits[index]
