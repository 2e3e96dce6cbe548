"""Group the (token, slot) pairs of a routing by expert into blocks of ``BM`` rows (each block one expert).

Output (:class:`SortedRouting`), all on the routing's device, computed without a host sync:

- ``sorted_pairs`` int32 [P_max]: row p of the padded layout holds pair index ``t * top_k + j``. Expert e owns
  rows ``[expert_start[e], expert_start[e] + padded(count[e]))``; its real pairs come first, in pair order,
  and the padding rows hold garbage (kernels mask rows ``p >= expert_start[e] + expert_count[e]``).
- ``block_expert`` int32 [NB_max]: expert of each block of BM rows, -1 past the last used block.
- ``expert_start`` int32 [E], ``expert_count`` int32 [E].
- ``num_blocks`` int32 [1]: the used blocks (``block_expert[b] >= 0`` exactly for ``b < num_blocks``), read by the
  persistent GEMMs on the device.
- ``work`` int32 [8], zeros: the item counters of the two GEMMs' dynamic schedule (words 0 and 4, 16-byte aligned).

The ids must lie in ``[0, num_experts)`` (``fused_moe`` checks them at its boundary).

P_max = NB_max * BM with NB_max = ceil(T*k / BM) + min(E, T*k), an upper bound on the used blocks, so grids are
sized on the host from shapes alone. Small routings (decode) use one Triton program (``_align_kernel``, one
launch: a histogram and a sort of all pairs in registers; 11-17 us at K3 decode on the H200, where the earlier
pairwise-compare kernel took 12-136 us); large ones use a stable torch sort, where launch count does not matter.
Both give identical arrays and neither syncs with the host (CUDA-graph safe).
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
    work: torch.Tensor  # int32 [8] zeros: item counters (words 0, 4) of the persistent GEMMs


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of BM-row blocks any routing of ``num_pairs`` pairs can use."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, work_ptr, num_pairs,
                  num_experts, num_blocks, BM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: every pair at once. Sort keys ``expert * BLOCK_P + pair`` (stable by construction), the
    histogram and two prefix sums give each sorted pair its row ``start[e] + (rank - first[e])``."""
    a = tl.arange(0, BLOCK_P)  # [P]
    amask = a < num_pairs
    ids = tl.load(ids_ptr + a, mask=amask, other=0)  # [P]
    ex = tl.arange(0, BLOCK_E)  # [E]
    emask = ex < num_experts
    # pairs per expert; the masked lanes were counted as expert 0
    counts = tl.histogram(ids, BLOCK_E) - tl.where(ex == 0, BLOCK_P - num_pairs, 0)  # [E]
    padded = (counts + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)  # [E] inclusive
    start = end - padded
    first = tl.cumsum(counts, axis=0) - counts  # [E] sorted position of each expert's first pair
    tl.store(start_ptr + ex, start, mask=emask)
    tl.store(count_ptr + ex, counts, mask=emask)
    used = tl.sum(tl.where(emask, padded, 0), axis=0) // BM
    tl.store(nblk_ptr, used)
    tl.store(work_ptr + tl.arange(0, 8), tl.zeros((8,), tl.int32))
    keys = tl.sort(tl.where(amask, ids * BLOCK_P + a, 2147483647))  # [P] by expert, then pair (masked last)
    e_sorted = tl.minimum(keys // BLOCK_P, BLOCK_E - 1)
    rows = a + tl.gather(start - first, e_sorted, 0)  # start[e] + (position - first[e])
    tl.store(sorted_ptr + rows, keys % BLOCK_P, mask=amask)
    # block b belongs to expert e for b in [start[e] / BM, end[e] / BM): a few passes over the experts
    nb = padded // BM  # [E]
    for j in range(0, tl.max(nb, axis=0)):
        tl.store(block_expert_ptr + start // BM + j, ex, mask=emask & (j < nb))
    for b0 in range(0, num_blocks, BLOCK_P):  # the unused tail
        b = b0 + a
        tl.store(block_expert_ptr + b, -1, mask=(b >= used) & (b < num_blocks))


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
    work = torch.zeros(8, dtype=torch.int32, device=dev)
    return SortedRouting(sorted_pairs, block_expert, start.to(torch.int32), counts.to(torch.int32), used, block_m,
                         work)


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, force: str | None = None) -> SortedRouting:
    """``topk_ids`` int [T, k] -> :class:`SortedRouting` with blocks of ``block_m`` rows.

    force: "kernel" or "torch" picks the implementation (tests); None chooses by size.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    use_kernel = num_pairs <= SMALL_PAIRS if force is None else force == "kernel"
    if use_kernel and (num_pairs > SMALL_PAIRS or triton.next_power_of_2(num_experts) > 1024):
        # the kernel holds every pair and expert in one program (sort keys expert * BLOCK_P + pair fit int32)
        raise ValueError(f"the align kernel takes up to {SMALL_PAIRS} pairs and 1024 experts, got {num_pairs} pairs "
                         f"and {num_experts} experts (use the torch path)")
    if not use_kernel:
        return _align_torch(flat, num_experts, block_m, num_blocks)
    dev = flat.device
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    start = torch.empty(num_experts, dtype=torch.int32, device=dev)
    count = torch.empty(num_experts, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    work = torch.empty(8, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        flat.to(torch.int32), sorted_pairs, block_expert, start, count, used, work, num_pairs, num_experts, num_blocks,
        BM=block_m, BLOCK_P=max(16, triton.next_power_of_2(num_pairs)), BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=8,
    )
    return SortedRouting(sorted_pairs, block_expert, start, count, used, block_m, work)
