"""MoE prefill at many rows per expert: dequantised experts + ``torch._grouped_mm`` (``gemm="grouped"``).

At prefill every expert gets hundreds to thousands of rows, the GEMMs are compute-bound and decoding MXFP4 inside
the MMA loop (:mod:`.kernels`, :mod:`.gemm_hopper`) costs MMA issue slots. This path decodes each used expert once
into a bf16 scratch and lets the bf16 grouped GEMM (cuBLAS/CUTLASS behind ``torch._grouped_mm``) run at its speed:

1. :func:`.align.align_routing` (16-row blocks; on the device) groups the (token, slot) pairs by expert. When every
   expert fits the scratch, all of them form one group and nothing is read on the host (the GEMMs take the
   experts' row ends on the device; rows past the last end hold zero inputs and uninitialised outputs that are never
   read back).
   Otherwise one host read of the per-expert starts and counts plans groups of used experts (a sync: never inside
   CUDA-graph capture).
2. ``_gather_kernel``: x rows (MXFP8-rounded first for A8W4, ``fused._mxfp8_round_trip``) in expert order, padding
   rows zero; it also records each pair's row.
3. Per group of experts that fits the scratch (``Settings.moe_grouped_scratch_mib``): ``dequant_kernel`` decodes
   w13 with :func:`.decode.weight_tile` (the fused path's decode, its portable variant: the inline-PTX one turns
   the four bytes of one packed asm operand into one word, which holds only in the register layout of the MMA
   kernels; in this store-only kernel it gave wrong weights on the H200, 2026-12-04; the portable decode builds
   each fp32 value from the code's bits, ~87 % of a copy's bandwidth at :data:`DEQUANT_TILE`) into
   [G, 2N, K] (gate rows, then up rows), ``torch._grouped_mm`` -> bf16 [rows, 2N], ``_act_kernel`` (the fused
   path's :func:`.kernels.gate_up_activation`, and for A8W4 its :func:`.kernels.mx_round_trip`) -> bf16 [rows, N],
   then w2 decoded into the same scratch [G, Kout, N] and ``torch._grouped_mm`` -> bf16 [rows, Kout].
4. ``_combine_kernel``: ``out[t] = sum_j w[t, j] * y[row(t, j)]`` in fp32, j in order (deterministic).

Differences to the fused path: the w13 output is rounded to bf16 before the activation (the fused path activates
its fp32 accumulator), and the w2 output is rounded to bf16 before the weighted sum. For A16W4 that moves the
output a few bf16 ulp (relative error to the reference as the fused path's); for A8W4 the bf16 w13 output flips
the MXFP8 rounding of ~2-3 % of the intermediate values by one E4M3 step (2.0e-2 relative error to the reference
on the interpreter test's shape, where the fused path has 4e-3), so the default rule takes A16W4 only; A8W4 runs
here when asked (``gemm="grouped"``).

:func:`auto_selects` is the default rule of ``fused_moe_with``: NVIDIA sm_90+, torch with ``_grouped_mm``, bf16 x,
MXFP4 experts, A16W4, not capturing a CUDA graph, and at least :data:`MIN_ROWS_PER_EXPERT` rows per expert on average.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import triton
import triton.language as tl

from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.settings import get_settings
from rocm_k3.triton_kernels.moe import layout
from rocm_k3.triton_kernels.moe.align import align_routing
from rocm_k3.triton_kernels.moe.decode import DECODE_PORTABLE, weight_tile
from rocm_k3.triton_kernels.moe.kernels import gate_up_activation, mx_round_trip

BLOCK_M = 16  # rows per expert are padded to this (the grouped GEMM's offsets)
# The measured break-even of the default rule, in routed rows per expert (T * top_k / E); benchmarks/RESULTS.md,
# "MoE prefill: dequant + bf16 grouped GEMM" (H200, K3 widths, top-16, A16W4, grouped eager vs ws graph replays):
# 4096 rows (E 32, T 8192) 15.18 ms against 19.72 (1.30x); 1024 rows 4.90 / 5.06 ms (E 32, T 2048) and 19.82 /
# 20.37 ms (E 128, T 8192); 512 rows 3.35 / 2.62 ms (E 32, T 1024); 256 rows 10.70 / 5.55 ms (E 128, T 2048);
# E 896 loses at every T <= 8192 (58-60 ms against 6-25: the dequant of all 896 experts, ~1.5 ms per 32 experts,
# is paid for at most 146 rows each). Below it the warp-specialised kernel stays.
MIN_ROWS_PER_EXPERT = 1024.0


@dataclasses.dataclass(frozen=True)
class DequantTile:
    """Launch shape of ``dequant_kernel``: ``ku`` 64-K units per program (2: one 128-K scale group, 4: two) and
    ``num_warps``. A ``ku`` the matrix's K groups do not divide falls back to 2 (the decode's loads are unmasked)."""

    ku: int = 2
    num_warps: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.ku, bool) or self.ku not in (2, 4):
            raise ValueError(f"DequantTile.ku must be 2 or 4, got {self.ku!r}")
        if isinstance(self.num_warps, bool) or self.num_warps not in (2, 4, 8, 16):
            raise ValueError(f"DequantTile.num_warps must be 2, 4, 8 or 16, got {self.num_warps!r}")


# the default launch shape. H200, K3 widths, 32 experts (benchmarks/RESULTS.md, bench_dequant.py): w13 0.481 ms
# (3.7 TB/s, 87 % of a copy) at KU 2 / 8 warps against 0.600 at 4 warps and 0.888 before the bit-built decode; on
# sm_90, 52 registers (4 warps: 178, two programs per SM). KU 4 is slower (8 warps 0.995 ms, 16 warps 0.535).
DEQUANT_TILE = DequantTile(2, 8)


@triton.jit
def dequant_kernel(w_ptr, ws_ptr, out_ptr, experts_ptr, R_OUT, K_OUT, stride_we, stride_wg, stride_wse,
                   stride_wsg, stride_oe, stride_or, GATE_UP: tl.constexpr, DECODE: tl.constexpr,
                   FOLD: tl.constexpr, KU: tl.constexpr):
    """out[i, row, k] (bf16) = the weight of expert experts[i] (``triton`` layout), one [128, 64 KU] tile per
    program: grid (experts, 128-row tiles, K tiles of 64 KU). GATE_UP (w13): tile rows 0..63 are gate rows
    64 tile + r, rows 64..127 the up rows, stored at R_OUT + 64 tile + r (R_OUT = N); else rows 128 tile + r.
    Rows >= R_OUT (per half) and K >= K_OUT are padding and not stored."""
    i = tl.program_id(0)
    tile = tl.program_id(1)
    kt = tl.program_id(2)
    e = tl.load(experts_ptr + i).to(tl.int64)
    kg = (kt * (KU // 2)).to(tl.int64)  # first 128-K group of the tile
    w_base = w_ptr + e * stride_we + (2 * tile) * stride_wg.to(tl.int64) + kg * 4096
    s_base = ws_ptr + e * stride_wse + (2 * tile) * stride_wsg.to(tl.int64) + kg * 256
    w = weight_tile(w_base, s_base, stride_wg, stride_wsg, DECODE, FOLD, False, KU)  # bf16 [128, 64 KU]
    r = tl.arange(0, 128)
    if GATE_UP:
        row = tile * 64 + r % 64
        rmask = row < R_OUT
        row = row + (r // 64) * R_OUT
    else:
        row = tile * 128 + r
        rmask = row < R_OUT
    k = kt * 64 * KU + tl.arange(0, 64 * KU)
    optr = out_ptr + i * stride_oe.to(tl.int64) + row.to(tl.int64)[:, None] * stride_or + k[None, :]
    tl.store(optr, w, mask=rmask[:, None] & (k < K_OUT)[None, :])


@triton.jit
def _gather_kernel(x_ptr, xs_ptr, row_of_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, n_rows, K, top_k,
                   stride_x, stride_xs, BM: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """xs[r] = x[pair(r) // top_k] for the real rows of the aligned layout, 0 for padding rows; row_of[pair] = r."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    e = tl.load(block_expert_ptr + rows // BM, mask=in_range, other=0)
    e = tl.maximum(e, 0)
    real = in_range & (rows < tl.load(start_ptr + e, mask=in_range, other=0) + tl.load(count_ptr + e, mask=in_range,
                                                                                         other=0))
    pair = tl.load(sorted_ptr + rows, mask=real, other=0)
    if tl.program_id(1) == 0:
        tl.store(row_of_ptr + pair, rows, mask=real)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    tok = (pair // top_k).to(tl.int64)
    v = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=real[:, None] & cmask[None, :], other=0.0)
    tl.store(xs_ptr + rows.to(tl.int64)[:, None] * stride_xs + cols[None, :], v.to(xs_ptr.dtype.element_ty),
             mask=in_range[:, None] & cmask[None, :])


@triton.jit
def _act_kernel(h_ptr, out_ptr, n_rows, N, stride_h, stride_out, beta, linear_beta, ACT: tl.constexpr,
                HAS_LINEAR_BETA: tl.constexpr, FAST: tl.constexpr, OUT_MX: tl.constexpr, EMAX: tl.constexpr,
                BIAS: tl.constexpr, FP8_MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out [R, N] = act(h[:, :N], h[:, N:]) with the fused path's epilogue math (fp32), MXFP8-rounded per 32
    columns if OUT_MX (N % 32 == 0, so no block straddles the end), in out's dtype."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    hp = h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :]
    gate = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(hp + N, mask=mask, other=0.0).to(tl.float32)
    v = gate_up_activation(gate, up, beta, linear_beta, ACT, HAS_LINEAR_BETA, FAST)  # [ROWS, BLOCK]
    if OUT_MX:
        v = mx_round_trip(v, ROWS, BLOCK, EMAX, BIAS, FP8_MAX)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _combine_kernel(y_ptr, row_of_ptr, tw_ptr, out_ptr, Kout, stride_y, stride_out, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[t] = sum_j tw[t, j] * y[row_of[t, j]] (fp32, j in order: deterministic), in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < Kout
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.load(row_of_ptr + t * TOP_K + j).to(tl.int64)
        acc += tl.load(tw_ptr + t * TOP_K + j) * tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0).to(
            tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


MIN_TORCH = (2, 9)  # torch._grouped_mm with zero-row groups (earlier builds could hang on them)


def _torch_version() -> tuple[int, int]:
    """(major, minor) of torch: the leading digits of its first two parts ('2.8rc1' -> (2, 8))."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def platform_allows(x: torch.Tensor) -> bool:
    """Where the grouped path can be the default: NVIDIA sm_90+, torch >= :data:`MIN_TORCH` with ``_grouped_mm``,
    not capturing a graph (with more experts than the scratch holds the path reads the expert counts on the host)."""
    return (x.device.type == "cuda" and torch.version.hip is None and hasattr(torch, "_grouped_mm")
            and _torch_version() >= MIN_TORCH and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and not torch.cuda.is_current_stream_capturing())


def rows_rule(tokens: int, top_k: int, num_experts: int) -> bool:
    """The measured break-even: at least :data:`MIN_ROWS_PER_EXPERT` routed rows per expert on average."""
    return tokens * top_k >= MIN_ROWS_PER_EXPERT * num_experts


def auto_selects(x: torch.Tensor, weights: ExpertWeights, tokens: int, top_k: int, act_quant: str) -> bool:
    """The default rule of ``fused_moe_with`` (see the module doc)."""
    return (act_quant == "bf16" and rows_rule(tokens, top_k, weights.num_experts)
            and _operand_problem(x, weights) is None and platform_allows(x))


def _operand_problem(x: torch.Tensor, weights: ExpertWeights) -> str | None:
    """Why the grouped GEMMs cannot take these operands, or None."""
    if not hasattr(torch, "_grouped_mm") or _torch_version() < MIN_TORCH:
        return f"torch {torch.__version__}: needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} with _grouped_mm"
    if x.dtype != torch.bfloat16:
        return f"x must be bf16 (the grouped GEMM's operands), got {x.dtype}"
    if weights.fmt != "mxfp4":
        return f"needs MXFP4 experts, got fmt={weights.fmt!r}"
    if weights.hidden % 8 or weights.out_features % 8:
        return "hidden and out_features must be multiples of 8 (16-byte grouped GEMM rows)"
    return None


def supports(x: torch.Tensor, weights: ExpertWeights, interp: bool) -> tuple[bool, str]:
    """Whether ``gemm="grouped"`` can run at all (explicit requests raise a ValueError with the reason)."""
    problem = _operand_problem(x, weights)
    if problem is None and x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        problem = "it reads the expert counts on the host: not inside CUDA-graph capture"
    if problem is None and x.device.type != "cuda" and not interp:
        problem = "needs a CUDA device (or the Triton interpreter)"
    if problem is None and x.device.type == "cuda" and (
            torch.version.hip is not None or torch.cuda.get_device_capability(x.device) < (9, 0)):
        problem = "the bf16 grouped GEMM runs on NVIDIA sm_90+ only"
    return (False, problem) if problem else (True, "supported")


def dequantize(weights: ExpertWeights, which: str, experts: torch.Tensor, out: torch.Tensor,
               tile: DequantTile | None = None) -> None:
    """bf16 weights of ``experts`` (int32 [G] expert ids, on the device) into ``out``: w13 [G, 2N, K] (gate rows,
    then up rows, the checkpoint order) or w2 [G, Kout, N]; ``weights`` in the ``triton`` layout; ``tile`` the
    launch shape (default :data:`DEQUANT_TILE`)."""
    if tile is not None and not isinstance(tile, DequantTile):
        raise TypeError(f"tile must be a DequantTile or None, got {type(tile).__name__}")
    tile = tile or DEQUANT_TILE
    t = weights.extras[layout.LAYOUT]
    w, ws, fold = (t.w13, t.w13_s, t.fold13) if which == "w13" else (t.w2, t.w2_s, t.fold2)
    rows, kdim = (weights.intermediate, weights.hidden) if which == "w13" else (weights.out_features,
                                                                               weights.intermediate)
    groups = experts.numel()
    if groups == 0:
        return
    ku = tile.ku if w.shape[2] % (tile.ku // 2) == 0 else 2  # whole tiles only: the code loads are unmasked
    grid = (groups, w.shape[1] // 2, w.shape[2] // (ku // 2))
    dequant_kernel[grid](w, ws, out, experts, rows, kdim, w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
                         out.stride(0), out.stride(1), GATE_UP=which == "w13", DECODE=DECODE_PORTABLE, FOLD=fold,
                         KU=ku, num_warps=tile.num_warps)


def _row_end(start, count):
    """End row of an expert's rows in the aligned layout (its count padded to BLOCK_M): ints or tensors alike."""
    return start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M


def _plan(start: list[int], count: list[int], per_group: int) -> list[tuple[list[int], int, int]]:
    """Groups of at most ``per_group`` used experts: (expert ids, first row, end row) of the aligned layout."""
    used = [e for e, c in enumerate(count) if c]
    groups = []
    for i in range(0, len(used), per_group):
        ids = used[i : i + per_group]
        end = _row_end(start[ids[-1]], count[ids[-1]])
        groups.append((ids, start[ids[0]], end))
    return groups


def fused_moe_grouped(xa: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      out: torch.Tensor, *, activation: MoEActivation, out_mx: tuple[int, int, float] | None,
                      fast_act: bool, scratch_bytes: int | None = None) -> torch.Tensor:
    """The grouped path into ``out`` [T, Kout]. ``xa``: bf16 x [T, K] (already MXFP8-rounded for A8W4),
    ``weights`` in the ``triton`` layout, ``out_mx``: (EMAX, BIAS, FP8_MAX) to round the intermediate through
    MXFP8 (A8W4), ``fast_act``: the epilogue's NVIDIA fast math, ``scratch_bytes``: the bf16 scratch bound
    (default the setting)."""
    tokens, top_k = topk_ids.shape
    num_experts, n, hidden, kout = weights.num_experts, weights.intermediate, weights.hidden, weights.out_features
    dev = xa.device
    routing = align_routing(topk_ids, num_experts, BLOCK_M)
    per_expert = 2 * max(2 * n * hidden, kout * n)  # bf16 bytes of one expert's larger matrix
    budget = scratch_bytes if scratch_bytes is not None else get_settings().moe_grouped_scratch_mib << 20
    per_group = max(1, budget // per_expert)
    if num_experts <= per_group:  # every expert in one group: no host read, the layout's bound as the rows
        ends = _row_end(routing.expert_start, routing.expert_count)  # [E] on device
        groups = [(torch.arange(num_experts, dtype=torch.int32, device=dev), 0, routing.sorted_pairs.numel(),
                   ends.to(torch.int32))]  # rows past ends[-1]: zero inputs, unread outputs
    else:  # the one host sync: plan groups of used experts that fit the scratch
        start, count = torch.stack((routing.expert_start, routing.expert_count)).tolist()
        groups = [(torch.tensor(ids, dtype=torch.int32).to(dev, non_blocking=True), r0, r1, torch.tensor(
                      [_row_end(start[e], count[e]) - r0 for e in ids],
                      dtype=torch.int32).to(dev, non_blocking=True))  # [G] group ends, relative to r0
                  for ids, r0, r1 in _plan(start, count, per_group)]
    n_rows = groups[-1][2]
    xs = torch.empty(n_rows, hidden, dtype=torch.bfloat16, device=dev)  # [rows, K] x in expert order
    row_of = torch.empty(tokens * top_k, dtype=torch.int32, device=dev)  # [T*k] row of each pair
    block_k = min(256, triton.next_power_of_2(hidden))
    _gather_kernel[(triton.cdiv(n_rows, 16), triton.cdiv(hidden, block_k))](
        xa, xs, row_of, routing.sorted_pairs, routing.block_expert, routing.expert_start, routing.expert_count,
        n_rows, hidden, top_k, xa.stride(0), xs.stride(0), BM=BLOCK_M, ROWS=16, BLOCK_K=block_k,
    )
    # sized for the budget (or all experts), not this call's first group: the engine's profiled prefill (dummy tokens
    # routed to only top_k experts) then reserves what a real step with many used experts takes
    scratch = torch.empty(min(per_group, num_experts) * per_expert // 2, dtype=torch.bfloat16, device=dev)
    # [rows, Kout]; the one-group path writes the w2 GEMM's output directly. Past the scratch, y is allocated even for
    # a single group of used experts, so a profiled step (dummy tokens: top_k experts) counts the several-group peak
    y = None if num_experts <= per_group else torch.empty(n_rows, kout, dtype=torch.bfloat16, device=dev)
    emax, bias, fmax = out_mx or (8, 7, 448.0)
    block_n = min(128, triton.next_power_of_2(n))
    for ids_dev, r0, r1, offs in groups:
        g = ids_dev.numel()
        w13 = scratch[: g * 2 * n * hidden].view(g, 2 * n, hidden)
        dequantize(weights, "w13", ids_dev, w13)
        h = torch._grouped_mm(xs[r0:r1], w13.transpose(-2, -1), offs=offs)  # [rows, 2N] bf16
        inter = torch.empty(r1 - r0, n, dtype=torch.bfloat16, device=dev)  # [rows, N]
        _act_kernel[(triton.cdiv(r1 - r0, 16), triton.cdiv(n, block_n))](
            h, inter, r1 - r0, n, h.stride(0), inter.stride(0), float(activation.beta),
            float(activation.linear_beta or 1.0), ACT=0 if activation.kind == "situ" else 1,
            HAS_LINEAR_BETA=activation.linear_beta is not None, FAST=fast_act, OUT_MX=out_mx is not None,
            EMAX=emax, BIAS=bias, FP8_MAX=fmax, ROWS=16, BLOCK=block_n,
        )
        del h
        w2 = scratch[: g * kout * n].view(g, kout, n)  # the w13 GEMM is done with the scratch (stream order)
        dequantize(weights, "w2", ids_dev, w2)
        yg = torch._grouped_mm(inter, w2.transpose(-2, -1), offs=offs)  # [rows, Kout] bf16
        if y is None:
            y = yg
        else:
            y[r0:r1] = yg
    tw = topk_weights.reshape(-1).to(torch.float32)
    block = min(1024, triton.next_power_of_2(kout))
    _combine_kernel[(tokens, triton.cdiv(kout, block))](y, row_of, tw, out, kout, y.stride(0), out.stride(0),
                                                        TOP_K=top_k, BLOCK=block)
    return out
