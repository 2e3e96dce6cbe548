"""Builds each step's :class:`ForwardBatch` from a :class:`StepInput` and runs the model (eager or a decode graph).

The runner keeps what the step contract sends only once or as deltas: each request's block table (a growing
int32 numpy row) and KDA slot. Per step it builds the host-side plan (token ids, positions, cu_seqlens, slot
mapping, block-table rows at a fixed width) in one pass, moves it to the device in a handful of copies, and
asks for logits only at the last token of the chunks that sample. Decode-only steps, and speculative
verifications (every chunk a decode plus its drafts), replay a captured graph when
:class:`~rocm_k3.worker.cuda_graph.DecodeGraphs` has one for the batch size and tokens per sequence; a
verification without a graph runs eagerly in the same decode shape (:mod:`~rocm_k3.worker.decode_layout`: the
recurrent KDA decode per drafted position, so no chunk kernel has to save states between its chunk ends); a step
that also holds prefill chunks runs its verifications so and its prefills in a second forward. On the first pipeline stage of
a vision model, :class:`~rocm_k3.worker.image_inputs.ImageInputs` (``images``) adds the step's image embedding
rows to the ForwardBatch (``image_embeds`` / ``image_rows``).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.worker.decode_layout import decode_layout, layout_batch
from rocm_k3.worker.image_inputs import ImageInputs, StepImages
from rocm_k3.worker.kv_pools import KVPools
from rocm_k3.worker.step_io import ScheduledChunk, StepInput

# Block tables are sent at the fixed width (blocks of one max_model_len request) while a step's table stays under
# this many entries, else at the width the step needs: kernels that size their work by the table width (the MLA
# decode's KV splits) then run identically with and without decode graphs.
FIXED_WIDTH_LIMIT = 1 << 16


class StepModel(Protocol):
    def forward(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor: ...


@dataclasses.dataclass
class _Row:
    """One request's cache view on the worker: block table (first ``num_blocks`` entries used) and KDA slot."""

    table: np.ndarray
    num_blocks: int
    kda_slot: int

    def extend(self, block_ids: tuple[int, ...]) -> None:
        need = self.num_blocks + len(block_ids)
        if need > self.table.shape[0]:
            grown = np.zeros(max(need, 2 * self.table.shape[0]), dtype=np.int32)
            grown[: self.num_blocks] = self.table[: self.num_blocks]
            self.table = grown
        self.table[self.num_blocks : need] = block_ids
        self.num_blocks = need

    def reserve(self, width: int) -> None:
        """Hold at least ``width`` entries (those past ``num_blocks`` are 0), so the row slices at that width."""
        if self.table.shape[0] < width:
            grown = np.zeros(width, dtype=np.int32)
            grown[: self.num_blocks] = self.table[: self.num_blocks]
            self.table = grown


@dataclasses.dataclass(frozen=True)
class PreviousTokens:
    """The tokens the last launched step sampled, on the device (asynchronous scheduling): ``token_ids`` int64
    [R] and the row of each request that sampled in it."""

    token_ids: torch.Tensor
    rows: dict[str, int]


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """The host-side arrays of one step (chunks in step order; decodes first)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    cu_seqlens: np.ndarray  # int32 [N+1]
    seq_lens: np.ndarray  # int32 [N]
    block_table: np.ndarray  # int32 [N, width]
    kda_slots: np.ndarray  # int32 [N]
    has_initial_state: np.ndarray  # bool [N]
    logits_indices: np.ndarray  # int64 [R] rows of the sampling chunks' last 1 + num_draft tokens
    save_positions: np.ndarray | None  # int32 [M, 2]
    save_slots: np.ndarray | None  # int32 [M]
    is_decode: bool


class ModelRunner:
    """Owns a step's device tensors: per-request cache rows, copies, the ForwardBatch, the forward itself.

    max_blocks_per_seq: the fixed width of block-table rows (blocks of one max_model_len request).
    """

    def __init__(self, model: StepModel, pools: KVPools, max_blocks_per_seq: int) -> None:
        self.model = model
        self.pools = pools
        self.device = pools.device
        self.block_size = pools.block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.rows: dict[str, _Row] = {}
        self.graphs = None  # DecodeGraphs, set by the worker once captured
        self.images: ImageInputs | None = None  # set by the worker on the first stage of a vision model
        # KV transfer: (StepInput) -> a cache view for the forward or None, after the copies; and (StepInput) ->
        # None after a forward that returned
        self.before_forward = None
        self.after_forward = None
        self.taps = None  # the model whose ``tapped`` hidden states feed a drafter (set by the worker)
        self._take = None  # this step's from_previous decodes: (chunk indices, rows in the previous samples, tokens)

    # ---- per-request state ---------------------------------------------------------------------------------
    def apply_requests(self, step: StepInput) -> None:
        """The step's request deltas: table rows and images (finished requests dropped); also for a step without
        chunks that only reports finished requests."""
        self.apply_deltas(step)
        if self.images is not None:
            self.images.apply(step)

    def apply_deltas(self, step: StepInput) -> None:
        """Drop finished requests, then (re)set or extend the rows of the scheduled ones."""
        for rid in step.finished_request_ids:
            self.rows.pop(rid, None)
        for chunk in step.chunks:
            if chunk.admitted:
                row = _Row(np.zeros(max(4, len(chunk.block_ids)), dtype=np.int32), 0, chunk.kda_slot)
                self.rows[chunk.request_id] = row
            else:
                row = self.rows.get(chunk.request_id)
                if row is None:
                    raise RuntimeError(f"step {step.step_id}: request {chunk.request_id!r} was never admitted")
                if chunk.slot_moved:  # a speculative rollback picked the state slot of a drafted position
                    row.kda_slot = chunk.kda_slot
                if row.kda_slot != chunk.kda_slot:
                    raise RuntimeError(f"step {step.step_id}: request {chunk.request_id!r} changed KDA slot "
                                       f"{row.kda_slot} -> {chunk.kda_slot} without re-admission")
            if chunk.block_ids:
                row.extend(chunk.block_ids)
            if row.num_blocks * self.block_size < chunk.end:
                raise RuntimeError(f"step {step.step_id}: request {chunk.request_id!r} has {row.num_blocks} blocks "
                                   f"for {chunk.end} tokens")

    # ---- the step ------------------------------------------------------------------------------------------
    def plan(self, step: StepInput) -> HostPlan:
        """The host arrays of a step whose deltas were applied (see :meth:`apply_deltas`)."""
        chunks = step.chunks
        if not chunks:
            raise ValueError(f"step {step.step_id}: no chunk to run")
        n = len(chunks)
        rows = [self.rows[c.request_id] for c in chunks]
        starts = np.array([c.start for c in chunks], dtype=np.int64)  # [N]
        if all(len(c.token_ids) == 1 for c in chunks):  # one token each (a decode step): no ragged layout
            lens = np.ones(n, dtype=np.int64)
            cu = np.arange(n + 1, dtype=np.int64)
            ids = np.array([c.token_ids[0] for c in chunks], dtype=np.int64)
            positions = starts
            seq_of_token = np.arange(n)  # [T]
        else:
            lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
            cu = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lens, out=cu[1:])
            total = int(cu[-1])
            ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=total)
            positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, lens)  # [T]
            seq_of_token = np.repeat(np.arange(n), lens)  # [T]
        seq_lens = (starts + lens).astype(np.int32)
        used = int((seq_lens.max() + self.block_size - 1) // self.block_size)
        if n * self.max_blocks_per_seq <= FIXED_WIDTH_LIMIT:
            used = self.max_blocks_per_seq  # the width a decode graph sees, so eager steps run the same kernels
        for row in rows:  # entries past a row's blocks are 0: the first ``used`` entries are its table row
            row.reserve(used)
        table = np.stack([row.table[:used] for row in rows])  # [N, used]
        blocks = table[seq_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        saves = [(i, pos - c.start, slot) for i, c in enumerate(chunks) if c.saves for pos, slot in c.saves]
        return HostPlan(
            input_ids=ids, positions=positions, slot_mapping=slot_mapping, cu_seqlens=cu.astype(np.int32),
            seq_lens=seq_lens, block_table=table,
            kda_slots=np.array([row.kda_slot for row in rows], dtype=np.int32),
            has_initial_state=starts > 0,
            logits_indices=logits_rows(chunks, cu),
            save_positions=np.array([[i, p] for i, p, _ in saves], dtype=np.int32).reshape(-1, 2) if saves else None,
            save_slots=np.array([s for _, _, s in saves], dtype=np.int32) if saves else None,
            is_decode=step.is_decode_only and bool((starts > 0).all()),
        )

    def batch(self, plan: HostPlan, images: StepImages | None = None) -> ForwardBatch:
        """The plan's arrays on the device (and the step's image rows)."""
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=dev(plan.input_ids), positions=dev(plan.positions), cu_seqlens=dev(plan.cu_seqlens),
            seq_lens=dev(plan.seq_lens), block_table=dev(plan.block_table), slot_mapping=dev(plan.slot_mapping),
            kda_slots=dev(plan.kda_slots), has_initial_state=dev(plan.has_initial_state),
            logits_indices=dev(plan.logits_indices),
            save_positions=None if plan.save_positions is None else dev(plan.save_positions),
            save_slots=None if plan.save_slots is None else dev(plan.save_slots),
            is_decode=plan.is_decode,
            image_embeds=None if images is None else images.embeds,
            image_rows=None if images is None else images.rows,
        )

    def execute(self, step: StepInput, previous: PreviousTokens | None = None) -> torch.Tensor:
        """Apply the step's deltas and copies, run the model; logits fp32 [S, vocab] for the sampling chunks.
        previous: the tokens the step before sampled, the inputs of the ``from_previous`` decodes."""
        self._take = _previous_rows(step, previous)
        self.apply_requests(step)
        if step.block_copies or step.state_copies:
            self.pools.apply_copies(step.block_copies, step.state_copies)
        view = self.before_forward(step) if self.before_forward is not None else None
        cache = self.pools if view is None else view
        head, tail = split_verifications(step)
        if tail is None:
            logits = self._forward(step, cache)
        else:  # verifications beside prefills: the verifications in decode shape, then the prefills (row order)
            first = self._forward(head, cache)
            tapped = None if self.taps is None else self.taps.tapped
            rest = self._forward(tail, cache)
            if first is None or rest is None:  # a pipeline stage before the last returns nothing
                logits = None
            else:
                if tapped is not None and self.taps.tapped is not None:
                    self.taps.tapped = torch.cat([tapped, self.taps.tapped])
                logits = torch.cat([first, rest])
        if self.after_forward is not None:
            self.after_forward(step)
        return logits

    def _forward(self, step: StepInput, cache: HybridCacheView) -> torch.Tensor | None:
        """The forward of a step whose deltas, copies and transfers were applied: a decode graph, a decode-shaped
        verification, or the general (prefill) path, over ``cache`` (the pools, or the KV transfer's view)."""
        plan = self.plan(step)
        width = graph_width(step, plan)
        key = None if width is None or self.graphs is None else self.graphs.key_for(len(step.chunks), width)
        if key is not None:  # None on a pipeline stage before the last (its state went on to the next stage)
            return self.graphs.run(plan, key, self._take_previous)
        if width is not None and width > 1:  # a verification: in decode shape, as its graph would run it
            pools = self.pools
            lay = decode_layout(plan, len(step.chunks), width, pad_block=pools.pad_block, block_size=self.block_size,
                                pad_slot=pools.pad_slot)
            return self.model.forward(layout_batch(lay, width, self.device), cache)
        if self.images is None:
            batch = self.batch(plan)
            self._take_previous(batch.input_ids, plan.cu_seqlens[:-1])
            return self.model.forward(batch, cache)
        batch = self.batch(plan, self.images.prepare(step, plan.cu_seqlens))
        self._take_previous(batch.input_ids, plan.cu_seqlens[:-1])
        logits = self.model.forward(batch, cache)
        self.images.release(step)
        return logits

    def _take_previous(self, input_ids: torch.Tensor, first_rows: np.ndarray) -> None:
        """Write the ``from_previous`` decodes' input tokens into ``input_ids`` (on the device, after the step's
        inputs were copied there): the previous step's samples. ``first_rows[i]``: the row of chunk i's first
        token."""
        if self._take is None:
            return
        chunks, src, prev = self._take
        dst = first_rows[chunks].astype(np.int64)
        k = len(dst)
        if (dst == np.arange(k)).all() and (src == np.arange(k)).all():  # the same decodes in the same order
            input_ids[:k].copy_(prev[:k])
            return
        index = torch.from_numpy(np.stack([dst, src]))  # [2, k] one copy
        if self.device.type == "cuda":  # pinned: a pageable source may make the copy wait for the step in flight
            index = index.pin_memory()
        index = index.to(self.device, non_blocking=True)
        input_ids[index[0]] = prev[index[1]].to(input_ids.dtype)


def _previous_rows(step: StepInput, previous: PreviousTokens | None):
    """(chunk indices of the step's ``from_previous`` decodes, their rows in ``previous``, its tokens), or None
    when it has none; a RuntimeError when the previous step did not sample one of them."""
    chunks = [i for i, c in enumerate(step.chunks) if c.from_previous]
    if not chunks:
        return None
    missing = [step.chunks[i].request_id for i in chunks if previous is None or step.chunks[i].request_id
               not in previous.rows]
    if missing:
        raise RuntimeError(f"step {step.step_id}: requests {missing} decode the previous step's token, which did "
                           "not sample them")
    src = np.fromiter((previous.rows[step.chunks[i].request_id] for i in chunks), dtype=np.int64, count=len(chunks))
    return np.array(chunks, dtype=np.int64), src, previous.token_ids


def split_verifications(step: StepInput) -> tuple[StepInput, StepInput | None]:
    """A step whose leading decodes include verifications and that also runs prefill chunks, as (the decodes and
    verifications, the prefills); any other step as (step, None). Chunks come decodes first, then verifications,
    then prefills, and only prefills ask for prompt log-probability rows, so the two steps' logits in that order
    are the whole step's."""
    cut = next((i for i, c in enumerate(step.chunks) if c.is_prefill), len(step.chunks))
    if cut == len(step.chunks) or not any(c.num_draft for c in step.chunks[:cut]):
        return step, None
    return (dataclasses.replace(step, chunks=step.chunks[:cut]),
            dataclasses.replace(step, chunks=step.chunks[cut:], num_decodes=0))


def model_passes(step: StepInput | None) -> int:
    """The model forwards :meth:`ModelRunner.execute` runs for ``step``: 0 without chunks, 2 for verifications
    beside prefills (:func:`split_verifications`), else 1. Data-parallel replicas step together: every one runs
    the most passes of any (idle ones for the rest), so their MoE layers' expert-parallel collectives pair up."""
    if step is None or not step.chunks:
        return 0
    return 1 if split_verifications(step)[1] is None else 2


def graph_width(step: StepInput, plan: HostPlan) -> int | None:
    """The tokens per sequence of a step that a decode graph can run (1: a decode; 1 + the most drafts: a
    verification whose every chunk is a sampled decode of its last token plus its drafts), else None."""
    if plan.is_decode:
        return 1
    if not all(c.sample and not c.is_prefill and not c.prompt_logprob_rows and not c.images and c.start > 0
               and c.num_tokens == 1 + c.num_draft and all(1 <= pos - c.start <= c.num_draft for pos, _ in c.saves)
               for c in step.chunks):
        return None
    return 1 + max(c.num_draft for c in step.chunks)


def sampling_chunks(step: StepInput) -> list[ScheduledChunk]:
    """The chunks whose next token the step samples, in the order of the logits rows."""
    return [c for c in step.chunks if c.sample]


def logits_rows(chunks: tuple[ScheduledChunk, ...], cu: np.ndarray) -> np.ndarray:
    """Token rows whose logits a step returns: the last 1 + num_draft tokens of each sampling chunk (a plain
    chunk: its last token; a verification: its last confirmed token and every draft), then, after all of those,
    the first ``prompt_logprob_rows`` tokens of each chunk that asks for prompt log-probabilities."""
    if not any(c.num_draft or c.prompt_logprob_rows for c in chunks):  # each sampling chunk's last token
        return (cu[1:] - 1)[np.array([c.sample for c in chunks], dtype=bool)].astype(np.int64)
    rows = [r for i, c in enumerate(chunks) if c.sample for r in range(int(cu[i + 1]) - 1 - c.num_draft, int(cu[i + 1]))]
    rows += [r for i, c in enumerate(chunks) for r in range(int(cu[i]), int(cu[i]) + c.prompt_logprob_rows)]
    return np.array(rows, dtype=np.int64)
