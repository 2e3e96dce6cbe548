"""Pieces shared by the KDA Triton kernels: device-side math helpers and the host-side varlen chunk plan.

Device helpers (``@triton.jit``, inlined into the kernels): ``grid_ids`` and ``chunk_bounds`` (program ids and
rows of the per-chunk grids), ``gate``, the KDA decay gate (safe gate ``L * sigmoid(exp(A_log) * (f + dt_bias))``
or softplus gate ``-exp(A_log) * softplus(f + dt_bias)``) in fp32, and the fp32 ``sigmoid_f32`` /
``softplus_f32`` it is made of.

Host helper :func:`plan_chunks` turns ``cu_seqlens`` into the list of 64-token chunks a varlen batch is cut into
(one host synchronisation per prefill call, like every varlen chunked kernel).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CHUNK = 64  # chunk length C of the chunked prefill (K3_SPEC section 2)


@triton.jit
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) in fp32."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def softplus_f32(x):
    """log(1 + exp(x)) without overflow: max(x, 0) + log(1 + exp(-|x|))."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def gate(f, a_log, dt_bias, lower_bound, SAFE_GATE: tl.constexpr):
    """Log-space decay g (fp32) from the raw gate input f; a_log is a scalar, dt_bias broadcasts with f."""
    x = f.to(tl.float32) + dt_bias
    a = tl.exp(a_log)
    if SAFE_GATE:
        g = lower_bound * sigmoid_f32(a * x)
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
    """The 64-token chunks of a varlen batch, sequences in order, chunks in order inside each sequence.

    chunk_seq:    int32 [NC]   sequence of each chunk.
    chunk_start:  int32 [NC]   first token (global row) of each chunk.
    seq_first_chunk: int32 [N+1] index of the first chunk of each sequence (last entry = NC).
    num_chunks:   NC (host int).
    bounds:       cu_seqlens as a host list.
    """

    chunk_seq: torch.Tensor
    chunk_start: torch.Tensor
    seq_first_chunk: torch.Tensor
    num_chunks: int
    bounds: list[int]


def plan_chunks(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> ChunkPlan:
    """Cut every sequence of ``cu_seqlens`` (int32 [N+1]) into chunks of ``chunk`` tokens (the last may be short)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    seqs, starts, first = [], [], [0]
    for i in range(len(bounds) - 1):
        n = -(-(bounds[i + 1] - bounds[i]) // chunk)
        seqs += [i] * n
        starts += [bounds[i] + j * chunk for j in range(n)]
        first.append(first[-1] + n)
    device = cu_seqlens.device
    return ChunkPlan(
        torch.tensor(seqs, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(first, dtype=torch.int32, device=device),
        len(seqs),
        bounds,
    )


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
