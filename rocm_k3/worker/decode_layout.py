"""A decode-shaped step: a decode, or a speculative verification laid out as groups of ``w`` rows.

Row ``i * w + j`` holds token j of sequence i (w = 1 + the most drafts of the step); a sequence with fewer tokens
pads its group, and groups ``n .. groups - 1`` are padding too (a decode graph's bucket). Padding rows touch only
the pools' scratch block and slot: token 0 at position 0, one cached token, the scratch block's slot, the scratch
KDA slot. Each real row is its own MLA attention row (seq_len = its position + 1, its sequence's block table), and
the KDA layers advance each group's state column by column (``ForwardBatch.decode_width``), saving the states after
column j < w - 1 into ``save_slots[i * (w - 1) + j]`` (the scratch slot where the plan saves nothing). The same
layout feeds the eager forward and the decode graphs' persistent buffers, so both run the same kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rocm_k3.model.forward_batch import ForwardBatch


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Host arrays of ``groups * w`` rows; ``rows``: the rows of the plan's logits_indices, in their order."""

    input_ids: np.ndarray  # int64 [R]
    positions: np.ndarray  # int64 [R]
    seq_lens: np.ndarray  # int32 [R]
    slot_mapping: np.ndarray  # int64 [R]
    kda_slots: np.ndarray  # int32 [R]
    block_table: np.ndarray  # int32 [R, width]
    save_slots: np.ndarray | None  # int32 [groups * (w - 1)], None when w == 1
    rows: np.ndarray  # int64 [logits rows]


LAYOUT_ROWS = ("input_ids", "positions", "seq_lens", "slot_mapping", "kda_slots")  # the [R] arrays


def decode_layout(plan, groups: int, w: int, *, pad_block: int, block_size: int, pad_slot: int,
                  out: dict[str, np.ndarray] | None = None) -> DecodeLayout:
    """The layout of a plan (a :class:`~rocm_k3.worker.model_runner.HostPlan` of ``n <= groups`` sequences with an
    initial state and at most ``w`` new tokens each) over ``groups`` groups of ``w`` rows.

    out: arrays to write the layout into (a decode graph's host mirror: each of :data:`LAYOUT_ROWS` and
    ``block_table`` [rows, >= the plan's table width] with at least ``groups * w`` rows); the returned layout's
    row arrays and block table are then views of them (only the plan's table columns of ``block_table`` are
    written). A plain decode (w = 1) is written there directly, without intermediate arrays."""
    n = plan.seq_lens.shape[0]
    if n > groups:
        raise ValueError(f"fill: {n} rows do not fit bucket {groups}")
    lens = np.diff(plan.cu_seqlens).astype(np.int64)  # [n]
    if lens.max() > w or lens.min() < 1:
        raise ValueError(f"fill: sequences of {lens.min()}..{lens.max()} new tokens do not fit width {w}")
    total = groups * w
    if w == 1:  # a decode: row i is sequence i, the padding after (the common step, laid out with slices)
        return _plain_layout(plan, n, total, pad_block=pad_block, block_size=block_size, pad_slot=pad_slot, out=out)
    dst = (np.arange(n)[:, None] * w + np.arange(w)[None, :])[np.arange(w)[None, :] < lens[:, None]]  # [T]
    seq = np.repeat(np.arange(n), lens)  # [T]

    def scatter(values: np.ndarray, pad: int, dtype) -> np.ndarray:
        out = np.full(total, pad, dtype=dtype)
        out[dst] = values
        return out

    table = np.zeros((total, plan.block_table.shape[1]), dtype=np.int32)
    table[:, 0] = pad_block  # columns past a row's blocks are never read
    table[dst] = plan.block_table[seq]
    saves = None
    if w > 1:
        saves = np.full(groups * (w - 1), pad_slot, dtype=np.int32)
        if plan.save_positions is not None:
            i, p = plan.save_positions[:, 0].astype(np.int64), plan.save_positions[:, 1].astype(np.int64)
            if ((p < 1) | (p >= lens[i])).any():
                raise ValueError("fill: a verification saves states only after its first 1 .. len - 1 tokens")
            saves[i * (w - 1) + p - 1] = plan.save_slots
    lay = DecodeLayout(
        input_ids=scatter(plan.input_ids, 0, np.int64), positions=scatter(plan.positions, 0, np.int64),
        seq_lens=scatter(plan.positions + 1, 1, np.int32),
        slot_mapping=scatter(plan.slot_mapping, pad_block * block_size, np.int64),
        kda_slots=scatter(plan.kda_slots[seq], pad_slot, np.int32), block_table=table, save_slots=saves,
        rows=dst[plan.logits_indices],
    )
    if out is None:
        return lay
    views = {name: out[name][:total] for name in LAYOUT_ROWS}
    views["block_table"] = out["block_table"][:total, : table.shape[1]]
    for name, view in views.items():
        view[...] = getattr(lay, name)
    return dataclasses.replace(lay, **views)


def _plain_layout(plan, n: int, total: int, *, pad_block: int, block_size: int, pad_slot: int,
                  out: dict[str, np.ndarray] | None) -> DecodeLayout:
    """:func:`decode_layout` at ``w = 1`` (one token per sequence): the plan's rows first, padding rows after."""
    def padded(name: str, values: np.ndarray, pad: int, dtype) -> np.ndarray:
        dst = np.empty(total, dtype=dtype) if out is None else out[name][:total]
        dst[:n] = values
        dst[n:] = pad
        return dst

    used = plan.block_table.shape[1]
    table = np.empty((total, used), dtype=np.int32) if out is None else out["block_table"][:total, :used]
    table[:n] = plan.block_table
    table[n:] = 0
    table[n:, 0] = pad_block  # columns past a row's blocks are never read
    return DecodeLayout(
        input_ids=padded("input_ids", plan.input_ids, 0, np.int64),
        positions=padded("positions", plan.positions, 0, np.int64),
        seq_lens=padded("seq_lens", plan.positions + 1, 1, np.int32),
        slot_mapping=padded("slot_mapping", plan.slot_mapping, pad_block * block_size, np.int64),
        kda_slots=padded("kda_slots", plan.kda_slots, pad_slot, np.int32), block_table=table, save_slots=None,
        rows=plan.logits_indices,
    )


def save_rows(groups: int, w: int, device: torch.device) -> torch.Tensor:
    """The fixed save rows of a (groups, w) layout: (i * w + j, 1) for j < w - 1, int32 [groups * (w - 1), 2]."""
    at = torch.arange(groups * w, dtype=torch.int32, device=device).view(groups, w)[:, : w - 1].reshape(-1)
    return torch.stack([at, torch.ones_like(at)], dim=1)


def layout_batch(layout: DecodeLayout, w: int, device: torch.device) -> ForwardBatch:
    """An eager ForwardBatch of a layout (every row's logits are not needed: only ``layout.rows``)."""
    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    total = layout.input_ids.shape[0]
    saves = {} if layout.save_slots is None else {"save_positions": save_rows(total // w, w, device),
                                                  "save_slots": dev(layout.save_slots)}
    return ForwardBatch(
        input_ids=dev(layout.input_ids), positions=dev(layout.positions),
        cu_seqlens=torch.arange(total + 1, dtype=torch.int32, device=device), seq_lens=dev(layout.seq_lens),
        block_table=dev(layout.block_table), slot_mapping=dev(layout.slot_mapping), kda_slots=dev(layout.kda_slots),
        has_initial_state=torch.ones(total, dtype=torch.bool, device=device), logits_indices=dev(layout.rows),
        is_decode=True, decode_width=w, **saves,
    )
