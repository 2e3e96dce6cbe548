"""Group the (token, slot) pairs of a routing by expert into blocks of ``BM`` rows (each block one expert).

Output (:class:`SortedRouting`), all on the routing's device, computed without a host sync:

- ``sorted_pairs`` int32 [P_max]: row p of the padded layout holds pair index ``t * top_k + j``. Expert e owns
  rows ``[expert_start[e], expert_start[e] + padded(count[e]))``; its real pairs come first, in pair order,
  and the padding rows hold garbage (kernels mask rows ``p >= expert_start[e] + expert_count[e]``).
- ``block_expert`` int32 [NB_max]: expert of each block of BM rows, -1 past the last used block.
- ``expert_start`` int32 [E], ``expert_count`` int32 [E].
- ``num_blocks`` int32 [1]: the used blocks (``block_expert[b] >= 0`` exactly for ``b < num_blocks``), read by the
  persistent GEMMs on the device.

P_max = NB_max * BM with NB_max = ceil(T*k / BM) + min(E, T*k), an upper bound on the used blocks, so grids are
sized on the host from shapes alone. Small routings (decode) use one Triton program (``_align_kernel``, one
launch); large ones use a stable torch sort, where launch count does not matter. Both give identical arrays and
neither syncs with the host (CUDA-graph safe).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SMALL_PAIRS = 4096  # T*k up to which the single-program kernel is used


class SortedRouting(NamedTuple):
    sorted_pairs: torch.Tensor  # int32 [P_max]
    block_expert: torch.Tensor  # int32 [NB_max]
    expert_start: torch.Tensor  # int32 [E]
    expert_count: torch.Tensor  # int32 [E]
    num_blocks: torch.Tensor  # int32 [1] used blocks
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of BM-row blocks any routing of ``num_pairs`` pairs can use."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, num_pairs, num_experts,
                  num_blocks, BM: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    ex = tl.arange(0, BLOCK_E)  # [E]
    emask = ex < num_experts
    a_local = tl.arange(0, BLOCK_A)  # [A]
    # pass 1: tokens per expert
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for a0 in range(0, num_pairs, BLOCK_A):
        ids = tl.load(ids_ptr + a0 + a_local, mask=a0 + a_local < num_pairs, other=-1)  # [A]
        counts += tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM  # [E]
    end = tl.cumsum(padded, axis=0)  # [E] inclusive
    start = end - padded
    tl.store(start_ptr + ex, start, mask=emask)
    tl.store(count_ptr + ex, counts, mask=emask)
    tl.store(nblk_ptr, tl.sum(tl.where(emask, padded, 0), axis=0) // BM)
    # pass 2: destination row of each pair = start[e] + pairs of e before it
    seen = tl.zeros((BLOCK_E,), tl.int32)
    earlier = a_local[None, :] < a_local[:, None]  # [A, A] j < i
    for a0 in range(0, num_pairs, BLOCK_A):
        amask = a0 + a_local < num_pairs
        ids = tl.load(ids_ptr + a0 + a_local, mask=amask, other=-1)  # [A]
        onehot = (ids[:, None] == ex[None, :]).to(tl.int32)  # [A, E]
        base = tl.sum(onehot * (start + seen)[None, :], axis=1)  # [A]
        within = tl.sum(((ids[None, :] == ids[:, None]) & earlier).to(tl.int32), axis=1)  # [A]
        tl.store(sorted_ptr + base + within, a0 + a_local, mask=amask)
        seen += tl.sum(onehot, axis=0)
    # expert of each block: number of experts whose padded range ends at or before the block's first row
    end_valid = tl.where(emask, end, 2147483647)
    for b0 in range(0, num_blocks, BLOCK_A):
        b = b0 + a_local  # [A]
        e = tl.sum((end_valid[None, :] <= (b * BM)[:, None]).to(tl.int32), axis=1)  # [A]
        tl.store(block_expert_ptr + b, tl.where(e < num_experts, e, -1), mask=b < num_blocks)


def _align_torch(flat: torch.Tensor, num_experts: int, block_m: int, num_blocks: int) -> SortedRouting:
    dev = flat.device
    ids = flat.to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)
    start = end - padded
    order = torch.sort(ids, stable=True).indices  # [P] pairs grouped by expert, pair order inside
    sorted_ids = ids[order]
    first = torch.cumsum(counts, 0) - counts  # [E] index of each expert's first pair in `order`
    rank = torch.arange(ids.numel(), device=dev) - first[sorted_ids]
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    sorted_pairs[start[sorted_ids] + rank] = order.to(torch.int32)
    block_first = torch.arange(num_blocks, device=dev) * block_m
    e = torch.searchsorted(end, block_first, right=True)  # [NB]
    block_expert = torch.where(e < num_experts, e, torch.full_like(e, -1)).to(torch.int32)
    used = (padded.sum() // block_m).to(torch.int32).reshape(1)
    return SortedRouting(sorted_pairs, block_expert, start.to(torch.int32), counts.to(torch.int32), used, block_m)


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, force: str | None = None) -> SortedRouting:
    """``topk_ids`` int [T, k] -> :class:`SortedRouting` with blocks of ``block_m`` rows.

    force: "kernel" or "torch" picks the implementation (tests); None chooses by size.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    use_kernel = num_pairs <= SMALL_PAIRS if force is None else force == "kernel"
    if not use_kernel:
        return _align_torch(flat, num_experts, block_m, num_blocks)
    dev = flat.device
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    count = torch.empty(num_experts, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        flat.to(torch.int32), sorted_pairs, block_expert, start, count, used, num_pairs, num_experts, num_blocks,
        BM=block_m, BLOCK_A=64, BLOCK_E=triton.next_power_of_2(num_experts), num_warps=8,
    )
    return SortedRouting(sorted_pairs, block_expert, start, count, used, block_m)
