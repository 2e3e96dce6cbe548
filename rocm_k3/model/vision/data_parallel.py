"""Encoder data parallelism, host side: split a batch of images across ranks and put the results back in order.

With tensor parallelism the tower runs data-parallel (SERVING_SPEC 6.5): every rank holds the full tower and
projector, runs :meth:`VisionModel.forward` on its share of the images, and the per-image embeddings are
all-gathered. This module is the part that needs no process group:

- :func:`split_images` balances images by patch count (largest first onto the least-loaded rank, the LPT rule
  vLLM's ``get_load_balance_assignment`` also uses), deterministically, so every rank computes the same split;
- :func:`select_images` cuts one rank's ``pixel_values`` / ``grid_thws`` out of the packed batch;
- :func:`gather_in_order` reassembles the per-rank outputs (after the all-gather) into the original image order;
- :func:`encode_data_parallel` puts them together over a TP group: split, run this rank's share, one all-gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from rocm_k3.ops import comm


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """``ranks[r]``: the image indices rank r runs (ascending); ``loads[r]``: their total patch count."""

    ranks: list[list[int]]
    loads: list[int]


def split_images(patch_counts: Sequence[int], world_size: int) -> ImageSplit:
    """Assign images to ``world_size`` ranks, balancing the patches each rank runs (attention cost grows
    faster than linearly, but the MLP GEMMs that dominate the tower are linear in patches)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, got {world_size!r}")
    counts = list(patch_counts)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"patch_counts: expected non-negative integers, got {counts}")
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(counts)), key=lambda j: (-counts[j], j)):
        r = min(range(world_size), key=lambda q: (loads[q], len(ranks[q]), q))
        ranks[r].append(i)
        loads[r] += counts[i]
    return ImageSplit([sorted(r) for r in ranks], loads)


def select_images(pixel_values: torch.Tensor, grid_thws: Sequence[Sequence[int]],
                  indices: Sequence[int]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The patches and grids of images ``indices`` (in that order) from a packed batch."""
    grids = [tuple(int(v) for v in g) for g in grid_thws]
    sizes = [t * h * w for t, h, w in grids]
    if sum(sizes) != pixel_values.shape[0]:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thws describe {sum(sizes)}")
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    for i in indices:
        if not 0 <= i < len(grids):
            raise ValueError(f"image index {i} outside [0, {len(grids)})")
    pieces = [pixel_values[starts[i]:starts[i + 1]] for i in indices]
    subset = torch.cat(pieces) if pieces else pixel_values[:0]
    return subset, [grids[i] for i in indices]


def gather_in_order(split: ImageSplit, per_rank: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Per-rank outputs (rank r's list follows ``split.ranks[r]``) -> one list in the original image order."""
    if len(per_rank) != len(split.ranks):
        raise ValueError(f"{len(per_rank)} rank outputs for a split over {len(split.ranks)} ranks")
    total = sum(len(r) for r in split.ranks)
    out: list[torch.Tensor | None] = [None] * total
    for r, (indices, outputs) in enumerate(zip(split.ranks, per_rank)):
        if len(outputs) != len(indices):
            raise ValueError(f"rank {r} returned {len(outputs)} outputs for {len(indices)} images")
        for i, t in zip(indices, outputs):
            out[i] = t
    return out  # type: ignore[return-value]  (every slot is filled: the split covers each image once)


def encode_data_parallel(model: Any, pixel_values: torch.Tensor, grid_thws: Sequence[Sequence[int]], ctx: Any, *,
                         ops: Any = None) -> list[torch.Tensor]:
    """Every image's embeddings ``[n_i, text_hidden]`` (in input order) on every rank of ``ctx``'s TP group.

    ``model`` is a full :class:`~rocm_k3.model.vision.model.VisionModel` on each rank. With ``tp_size`` 1 it just
    runs; otherwise the images are split by :func:`split_images` (the same split on every rank), each rank runs
    its share and the rows are all-gathered once through ``rocm_k3.ops.comm`` (each rank's rows padded to the
    largest share, since a gather moves equal shapes), counted as ``vision_all_gather``. ``ops``: the op table
    (or backend name) the collective dispatches through.
    """
    grids = [tuple(int(v) for v in g) for g in grid_thws]
    if ctx.tp_size == 1:
        return model(pixel_values, grids)
    cfg = model.cfg
    kh, kw = cfg.merge_kernel_size
    tokens = [(h // kh) * (w // kw) for _, h, w in grids]  # sd2_tpool: the time axis is pooled
    split = split_images([t * h * w for t, h, w in grids], ctx.tp_size)
    mine = split.ranks[ctx.tp_rank]
    pixels, my_grids = select_images(pixel_values, grids, mine)
    local = model(pixels, my_grids) if mine else []
    rows = [sum(tokens[i] for i in indices) for indices in split.ranks]
    width = max(rows)
    param = next(model.parameters())
    flat = torch.zeros(width, cfg.text_hidden_size, dtype=param.dtype, device=param.device)  # [max rows, hidden]
    if local:
        flat[: rows[ctx.tp_rank]] = torch.cat(local)
    ctx.count("vision_all_gather")
    gathered = comm.all_gather(flat, ctx.tp_group, dim=0, backend=ops)  # [tp * max rows, hidden]
    per_rank = []
    for r, indices in enumerate(split.ranks):
        block = gathered[r * width : r * width + rows[r]]
        per_rank.append(list(block.split([tokens[i] for i in indices])) if indices else [])
    return gather_in_order(split, per_rank)
