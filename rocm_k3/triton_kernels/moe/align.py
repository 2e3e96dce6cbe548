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
launch: a histogram and a sort of all pairs in registers; 11-17 us at K3 T <= 64 on the H200, where the earlier
pairwise-compare kernel took 12-136 us). Larger ones (prefill) use three launches over chunks of CHUNK pairs:
per-chunk histograms, one program that sums them into the layout (and each expert's pairs in the chunks before
each chunk), and a per-chunk sort that stores the pairs from there (the torch path took ~120 us at K3 T = 512
and 2048; 4096-pair chunks 83 us, of which 70 us the sorts). Routings over more than 1024 experts use a stable
torch sort. All give identical arrays and none syncs with the host (CUDA-graph safe).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Pairs up to which the single-program kernel is used, and pairs per program of the chunked kernels: one program's
# sort of 4096 pairs took ~70 us on the H200 (1024: 16.8 us for the whole single-program align at K3 T = 64)
SMALL_PAIRS = 1024
CHUNK = 1024
MAX_EXPERTS = 1024  # experts the kernels hold in one program (next power of two of E)


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
def _histogram(ids, n_valid, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pairs per expert [BLOCK_E] of ``ids`` [BLOCK_P] whose first ``n_valid`` lanes are real (the masked lanes
    were loaded as expert 0)."""
    ex = tl.arange(0, BLOCK_E)
    return tl.histogram(ids, BLOCK_E) - tl.where(ex == 0, BLOCK_P - n_valid, 0)


@triton.jit
def _expert_layout(counts, start_ptr, count_ptr, nblk_ptr, work_ptr, block_expert_ptr, num_experts, num_blocks,
                   BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """From the pairs per expert [BLOCK_E]: write expert_start / expert_count / num_blocks / block_expert and zero
    the item counters; returns the experts' first rows ``start`` [BLOCK_E]."""
    ex = tl.arange(0, BLOCK_E)
    emask = ex < num_experts
    padded = (counts + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)  # [E] inclusive
    start = end - padded
    tl.store(start_ptr + ex, start, mask=emask)
    tl.store(count_ptr + ex, counts, mask=emask)
    used = tl.sum(tl.where(emask, padded, 0), axis=0) // BM
    tl.store(nblk_ptr, used)
    tl.store(work_ptr + tl.arange(0, 8), tl.zeros((8,), tl.int32))
    # block b belongs to expert e for b in [start[e] / BM, end[e] / BM): a few passes over the experts
    nb = padded // BM  # [E]
    for j in range(0, tl.max(nb, axis=0)):
        tl.store(block_expert_ptr + start // BM + j, ex, mask=emask & (j < nb))
    for b0 in range(0, num_blocks, BLOCK_B):  # the unused tail
        b = b0 + tl.arange(0, BLOCK_B)
        tl.store(block_expert_ptr + b, -1, mask=(b >= used) & (b < num_blocks))
    return start


@triton.jit
def _scatter_sorted(ids, amask, counts, first_row, sorted_ptr, pair0, BLOCK_P: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    """Store the pairs ``pair0 + lane`` of ``ids`` [BLOCK_P] (real where ``amask``) grouped by expert: expert e's
    pairs, in pair order, at rows ``first_row[e], first_row[e] + 1, ...`` (``counts``: their number per expert).
    Sort keys ``expert * BLOCK_P + lane`` (stable by construction). The store is masked by ``amask`` at the
    *sorted* positions: right because the unreal lanes are a suffix and their keys sort last."""
    a = tl.arange(0, BLOCK_P)
    first = tl.cumsum(counts, axis=0) - counts  # [E] sorted position of each expert's first pair
    keys = tl.sort(tl.where(amask, ids * BLOCK_P + a, 2147483647))  # [P] by expert, then lane (masked last)
    e_sorted = tl.minimum(keys // BLOCK_P, BLOCK_E - 1)
    rows = a + tl.gather(first_row - first, e_sorted, 0)  # first_row[e] + (position - first[e])
    tl.store(sorted_ptr + rows, pair0 + keys % BLOCK_P, mask=amask)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, work_ptr, num_pairs,
                  num_experts, num_blocks, BM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr = False):
    """One program: every pair at once (a histogram, the layout, one sort). PDL (NVIDIA, launched with
    ``launch_pdl``): it lets the next kernel's programs start at once (they wait for it on the device) and waits for
    the previous kernel (the router) before reading the ids."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    a = tl.arange(0, BLOCK_P)  # [P]
    amask = a < num_pairs
    ids = tl.load(ids_ptr + a, mask=amask, other=0)  # [P]
    counts = _histogram(ids, num_pairs, BLOCK_P, BLOCK_E)  # [E]
    start = _expert_layout(counts, start_ptr, count_ptr, nblk_ptr, work_ptr, block_expert_ptr, num_experts,
                           num_blocks, BM, BLOCK_E, BLOCK_P)
    _scatter_sorted(ids, amask, counts, start, sorted_ptr, 0, BLOCK_P, BLOCK_E)


@triton.jit
def _chunk_count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """Chunked align, pass 1 (one program per BLOCK_P pairs): counts[c, e] = pairs of chunk c routed to e."""
    c = tl.program_id(0)
    a = c * BLOCK_P + tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + a, mask=a < num_pairs, other=0)
    counts = _histogram(ids, tl.minimum(num_pairs - c * BLOCK_P, BLOCK_P), BLOCK_P, BLOCK_E)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _chunk_scan_kernel(counts_ptr, before_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, work_ptr,
                       num_chunks, num_experts, num_blocks, BM: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_B: tl.constexpr):
    """Pass 2 (one program, one pass over the chunks): before[c, e] = the pairs of expert e in the chunks before
    c, and the layout from the summed counts."""
    ex = tl.arange(0, BLOCK_E)
    run = tl.zeros((BLOCK_E,), tl.int32)
    for c in range(0, num_chunks):
        tl.store(before_ptr + c * BLOCK_E + ex, run)
        run += tl.load(counts_ptr + c * BLOCK_E + ex)
    _expert_layout(run, start_ptr, count_ptr, nblk_ptr, work_ptr, block_expert_ptr, num_experts, num_blocks, BM,
                   BLOCK_E, BLOCK_B)


@triton.jit
def _chunk_scatter_kernel(ids_ptr, counts_ptr, before_ptr, start_ptr, sorted_ptr, num_pairs, num_experts,
                          BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pass 3 (one program per chunk): the chunk's pairs sorted by expert, stored from row start[e] + before[c, e]
    on (expert e's first row plus its pairs in the earlier chunks)."""
    c = tl.program_id(0)
    a = c * BLOCK_P + tl.arange(0, BLOCK_P)
    amask = a < num_pairs
    ids = tl.load(ids_ptr + a, mask=amask, other=0)
    ex = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + c * BLOCK_E + ex)
    first_row = tl.load(before_ptr + c * BLOCK_E + ex) + tl.load(start_ptr + ex, mask=ex < num_experts, other=0)
    _scatter_sorted(ids, amask, counts, first_row, sorted_ptr, c * BLOCK_P, BLOCK_P, BLOCK_E)


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


def _empty_routing(num_blocks: int, num_experts: int, block_m: int, dev: torch.device) -> SortedRouting:
    """The output arrays the align kernels fill (every element is written on the device)."""
    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=dev)
    return SortedRouting(empty(num_blocks * block_m), empty(num_blocks), empty(num_experts), empty(num_experts),
                         empty(1), block_m, empty(8))


def align_path(num_pairs: int, num_experts: int) -> str:
    """The implementation :func:`align_routing` uses by default: "kernel" (one program) up to SMALL_PAIRS pairs,
    "chunked" beyond, "torch" past MAX_EXPERTS experts."""
    if triton.next_power_of_2(num_experts) > MAX_EXPERTS:
        return "torch"
    return "kernel" if num_pairs <= SMALL_PAIRS else "chunked"


def align_warps(num_pairs: int) -> int:
    """Warps of the one-program align kernel: its work is a chain of small reductions, scans and a sort, where
    fewer warps mean fewer cross-warp barriers. On the H200 at 896 experts (benchmarks/RESULTS.md, session 9):
    16 / 64 / 256 pairs 5.1 / 5.2 / 7.0 us at 2 warps (10.9 / 11.3 / 12.0 at 8); 1024 pairs 14.8 us at 4 (2: 18.8,
    8: 16.8)."""
    return 2 if num_pairs <= 256 else 4


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, force: str | None = None,
                  chunk: int = CHUNK, pdl: bool = False) -> SortedRouting:
    """``topk_ids`` int [T, k] -> :class:`SortedRouting` with blocks of ``block_m`` rows.

    force: "kernel" (one program), "chunked" (three launches over ``chunk`` pairs per program, a power of two)
    or "torch" picks the implementation (tests); None: :func:`align_path`. pdl: launch the one-program kernel as
    a programmatic dependent launch (NVIDIA sm_90+ only; the next kernel must wait for it on the device).
    """
    if not isinstance(pdl, bool):
        raise TypeError(f"pdl must be a bool, got {pdl!r}")
    if force not in (None, "kernel", "chunked", "torch"):
        raise ValueError(f"force must be None, 'kernel', 'chunked' or 'torch', got {force!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1) or chunk > CHUNK:
        raise ValueError(f"chunk must be a power of two in [16, {CHUNK}], got {chunk!r}")
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    force = force or align_path(num_pairs, num_experts)
    if force != "torch" and block_e > MAX_EXPERTS:
        raise ValueError(f"the align kernels take up to {MAX_EXPERTS} experts, got {num_experts} (use the torch path)")
    if force == "kernel" and num_pairs > SMALL_PAIRS:
        # one program sorts every pair: past SMALL_PAIRS the chunked kernels are faster
        raise ValueError(f"the align kernel takes up to {SMALL_PAIRS} pairs and {MAX_EXPERTS} experts, got "
                         f"{num_pairs} pairs (use the chunked kernels)")
    if force == "torch":
        return _align_torch(flat, num_experts, block_m, num_blocks)
    r = _empty_routing(num_blocks, num_experts, block_m, flat.device)
    ids = flat.to(torch.int32)
    layout = (r.block_expert, r.expert_start, r.expert_count, r.num_blocks, r.work)
    if force == "kernel":
        _align_kernel[(1,)](ids, r.sorted_pairs, *layout, num_pairs, num_experts, num_blocks, BM=block_m,
                            BLOCK_P=max(16, triton.next_power_of_2(num_pairs)), BLOCK_E=block_e, PDL=pdl,
                            num_warps=align_warps(num_pairs), **({"launch_pdl": True} if pdl else {}))
        return r
    chunks = triton.cdiv(num_pairs, chunk)
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=flat.device)  # [C, E]
    before = torch.empty_like(counts)  # [C, E]
    _chunk_count_kernel[(chunks,)](ids, counts, num_pairs, BLOCK_P=chunk, BLOCK_E=block_e, num_warps=8)
    _chunk_scan_kernel[(1,)](counts, before, *layout, chunks, num_experts, num_blocks, BM=block_m, BLOCK_E=block_e,
                             BLOCK_B=1024, num_warps=8)
    _chunk_scatter_kernel[(chunks,)](ids, counts, before, r.expert_start, r.sorted_pairs, num_pairs, num_experts,
                                     BLOCK_P=chunk, BLOCK_E=block_e, num_warps=8)
    return r
