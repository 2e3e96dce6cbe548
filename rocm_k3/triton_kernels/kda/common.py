"""Pieces shared by the KDA Triton kernels: device-side math helpers and the varlen chunk plan.

Device helpers (``@triton.jit``, inlined into the kernels): ``grid_ids`` and ``chunk_bounds`` (program ids and
rows of the per-chunk grids), ``gate``, the KDA decay gate (safe gate ``L * sigmoid(exp(A_log) * (f + dt_bias))``
or softplus gate ``-exp(A_log) * softplus(f + dt_bias)``) in fp32, and the fp32 ``sigmoid_f32`` /
``softplus_f32`` it is made of.

:func:`plan_chunks` turns ``cu_seqlens`` into the list of 64-token chunks a varlen batch is cut into, on the device
(one small launch; the host never reads ``cu_seqlens`` back, so it can run ahead of the GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CHUNK = 64  # chunk length C of the chunked prefill (K3_SPEC section 2)


@triton.jit
def exp_f32(x, FAST: tl.constexpr = False):
    """exp(x) in fp32: ``tl.exp``, or (FAST) ``exp2(x log2 e)``, the same ex2.approx (NVIDIA) / v_exp_f32 (AMD)
    without tl.exp's denormal-range fix-up (sm_90: a compare, a select and a multiply per call): results below
    2^-126 flush to 0, which no caller tells from 0."""
    if FAST:
        return tl.exp2(x * 1.4426950408889634)  # log2(e)
    return tl.exp(x)


@triton.jit
def sigmoid_f32(x, FAST: tl.constexpr = False):
    """1 / (1 + exp(-x)) in fp32; FAST: exp_f32's exponential and the reciprocal as rsqrt(1 + e)^2 (approximate
    rsqrt and a multiply, ~2^-22 relative, where the division's sm_90 form has a range check and a slow-path branch;
    1 + e >= 1, so the square root is real)."""
    if FAST:
        r = tl.math.rsqrt(1.0 + exp_f32(-x, FAST))
        return r * r
    return 1.0 / (1.0 + exp_f32(-x, FAST))


@triton.jit
def softplus_f32(x):
    """log(1 + exp(x)) without overflow: max(x, 0) + log(1 + exp(-|x|))."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def gate(f, a_log, dt_bias, lower_bound, SAFE_GATE: tl.constexpr, FAST_EXP: tl.constexpr = False):
    """Log-space decay g (fp32) from the raw gate input f; a_log is a scalar, dt_bias broadcasts with f (FAST_EXP:
    the safe gate's sigmoid through exp_f32's FAST form)."""
    x = f.to(tl.float32) + dt_bias
    a = tl.exp(a_log)
    if SAFE_GATE:
        g = lower_bound * sigmoid_f32(a * x, FAST_EXP)
    else:
        g = -a * softplus_f32(x)
    return g


@triton.jit
def grid_ids(M: tl.constexpr):
    """(chunk, head, minor) program ids of a grid (NC * M, H) whose first axis runs the minor index fastest: blocks
    launch in order of the first axis, so the M programs of one (chunk, head) run side by side and share the rows
    they each read through L2 (and NC stays on the first axis, which has no 65535 limit)."""
    return tl.program_id(0) // M, tl.program_id(1), tl.program_id(0) % M


@triton.jit
def chunk_bounds(chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, c, BT: tl.constexpr):
    """(first row, number of rows) of chunk c of the plan (the last chunk of a sequence may be short)."""
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    return t0, tl.minimum(tl.load(cu_seqlens_ptr + seq + 1) - t0, BT)


class ChunkPlan(NamedTuple):
    """The chunk slots of a varlen batch: sequences in order, chunks in order inside each sequence, then the unused
    slots. Built on the device (:func:`plan_chunks`), so the host never waits for ``cu_seqlens``: the number of
    chunks is not known on the host, only its bound ``num_chunks``. An unused slot points past the last token (its
    sequence N - 1, its first row ``cu_seqlens[N]``), so it has no rows and the kernels' row masks make it a no-op.

    chunk_seq:    int32 [num_chunks]   sequence of each chunk.
    chunk_start:  int32 [num_chunks]   first token (global row) of each chunk.
    seq_first_chunk: int32 [N+1] index of the first chunk of each sequence (last entry = the chunks in use).
    num_chunks:   slots (host int): an upper bound of the chunks in use (:func:`chunk_slots`), the best one from
                  T and N alone: exact for one sequence whose length is a multiple of the chunk; up to N - 1 slots
                  over when every length is.
    """

    chunk_seq: torch.Tensor
    chunk_start: torch.Tensor
    seq_first_chunk: torch.Tensor
    num_chunks: int


def chunk_slots(total_tokens: int, num_seqs: int, chunk: int) -> int:
    """Upper bound of the chunks ``num_seqs`` sequences of ``total_tokens`` tokens in all are cut into: the sum of
    ceil(l_i / chunk) is at most (T + N (chunk - 1)) // chunk, and at most T (no chunk is empty)."""
    return min(total_tokens, (total_tokens + num_seqs * (chunk - 1)) // chunk)


@triton.jit
def chunk_plan_kernel(cu_seqlens_ptr, chunk_seq_ptr, chunk_start_ptr, seq_first_ptr, N, num_slots,
                      BT: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(num_slots, BLOCK),): every program sums the chunks per sequence itself ([NP] >= N + 1 lanes) and
    fills BLOCK slots; program 0 also writes seq_first_chunk."""
    i = tl.arange(0, NP)
    mi = i < N
    lo = tl.load(cu_seqlens_ptr + i, mask=mi, other=0)
    hi = tl.load(cu_seqlens_ptr + i + 1, mask=mi, other=0)
    nch = tl.where(mi, (hi - lo + BT - 1) // BT, 0)  # [NP] chunks of each sequence
    ends = tl.cumsum(nch, axis=0)  # one past each sequence's last chunk
    first = ends - nch
    used = tl.sum(nch, axis=0)
    if tl.program_id(0) == 0:
        tl.store(seq_first_ptr + i, first, mask=mi)
        tl.store(seq_first_ptr + N, used)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] slots
    # the sequence of slot c: how many sequences end at or before it (N for an unused slot)
    seq = tl.sum((tl.where(mi, ends, used + 1)[None, :] <= c[:, None]).to(tl.int32), axis=1)
    seq = tl.minimum(seq, N - 1)
    pick = i[None, :] == seq[:, None]  # [BLOCK, NP]
    seq_lo = tl.sum(tl.where(pick, lo[None, :], 0), axis=1)  # [BLOCK] the sequence's first row
    seq_c0 = tl.sum(tl.where(pick, first[None, :], 0), axis=1)  # [BLOCK] and its first chunk
    start = seq_lo + (c - seq_c0) * BT
    start = tl.where(c < used, start, tl.load(cu_seqlens_ptr + N))  # unused: no rows
    tl.store(chunk_seq_ptr + c, seq, mask=c < num_slots)
    tl.store(chunk_start_ptr + c, start, mask=c < num_slots)


def plan_chunks(cu_seqlens: torch.Tensor, total_tokens: int, chunk: int = CHUNK) -> ChunkPlan:
    """Cut every sequence of ``cu_seqlens`` (int32 [N+1], N >= 1, contiguous) into chunks of ``chunk`` tokens (the
    last may be short), on the device: one small launch and no host synchronisation; ``total_tokens`` (T, the
    rows of the batch, = cu_seqlens[N]) bounds the slots (:func:`chunk_slots`)."""
    n = cu_seqlens.shape[0] - 1
    slots = chunk_slots(total_tokens, n, chunk) if n > 0 else 0  # no sequence: no chunk, whatever T says
    out = torch.empty(2 * slots + n + 1, dtype=torch.int32, device=cu_seqlens.device)
    plan = ChunkPlan(out[:slots], out[slots: 2 * slots], out[2 * slots:], slots)
    np_ = triton.next_power_of_2(n + 1)
    block = max(2, min(1024, 8192 // np_))  # [BLOCK, NP] stays at 8192 lanes
    if slots > 0:
        chunk_plan_kernel[(triton.cdiv(slots, block),)](
            cu_seqlens, plan.chunk_seq, plan.chunk_start, plan.seq_first_chunk, n, slots,
            BT=chunk, NP=np_, BLOCK=block, num_warps=4)
    else:
        plan.seq_first_chunk.zero_()
    return plan


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
