"""Triton ``kda_prefill``: chunked (C = 64) KDA over a varlen batch, in three launches (default: prep, intra with
the diagonal inverses, the state walk that solves, ``SOLVE_IN_WALK``) or four (phase 3 as its own launch).

    phase 1  chunk_prep   gate, in-chunk cumsum of g, beta sigmoid (NORMS_IN_INTRA, the default; with bf16
                          activations, GATE_FACTORS, written as bf16 sub-block factors E = exp(G - G_m) and fp32
                          G_m per chunk instead of fp32 G); without it also the q/k L2 norm and scale and the decayed
                          q and k
    phase 2  chunk_intra  in-chunk A and Aqk, per 16-row sub-block (and, SOLVE_KB, the solve's X = b exp(G) k';
                          INTRA_INVERTS, the diagonal blocks' inverses T_II in A's place; NORMS_IN_INTRA, the q/k
                          norms and the decayed q and k)
    phase 3  chunk_solve  the WY form W = (I + A)^-1 X, U = (I + A)^-1 (b v), by block forward substitution
    SOLVE_IN_WALK         no phase 3: the state walk solves V' = (I + A)^-1 (b v - KB S) per chunk itself
    phase 4  chunk_state  sequential state recurrence over each sequence's chunks + output
             (or, with SPLIT_OUTPUT, the recurrence alone and then chunk_output over all chunks in parallel)

q, k and v are read in place when their token rows are strided (head stride D, element stride 1: the model passes
column slices of the short conv's [T, 3HD] output; chunk_prep, and chunk_intra with NORMS_IN_INTRA, take q's and k's
row strides).
Measured and removed (session 20; RESULTS.md has their numbers, git history their code): phases 1-3 in one launch
(FUSED, chunk_fused: not faster on the H200, 255 registers and spills), phases 2 and 3 in one (MERGE_WY, chunk_wy:
25-30 % slower on the H200), phases 1 and 2 in one (PREP_IN_INTRA, chunk_prep_intra: 2x slower than the two
launches on the H100, twice). Session 27 (H100): an L2 prefetch of the walk's next chunk (noise), the walk at 8 warps
(2.1x slower) and the walk transposed onto S^T with wgmma (chunk_state_t: 21-54 % slower). Session 28 (H100): the
gate and the cumsum in the intra kernel (GATE_IN_INTRA: the prep writing only G's 16-row sub-block bounds, 0.75 KB
per token and head less, but chunk_intra 50 % more instructions: 20 % slower end to end).
Signature and semantics are those of :func:`rocm_k3.ops.kda.kda_prefill` (minus ``backend``). Intermediate
states can only be taken at chunk ends: every ``intermediate_positions`` row (i, p) needs p % 64 == 0.
Range: the in-chunk decay factors are exact while per-token |g| < 11 (see chunk_intra); K3's safe gate keeps
|g| < 5. A softplus gate or a raw g beyond that can overflow fp32 inside a 16-token sub-block (or take
GATE_FACTORS' bf16 E, whose exponent range is fp32's, to inf or to 0, whose reciprocal is inf: NaN in o).
"""

from __future__ import annotations

import torch
import triton.language as tl

from rocm_k3.ops.kda.datatypes import KDAGateParams, KDAPrefillOutput
from rocm_k3.triton_kernels.kda.chunk_intra import chunk_intra_kernel
from rocm_k3.triton_kernels.kda.chunk_output import chunk_output_kernel
from rocm_k3.triton_kernels.kda.chunk_prep import chunk_prep_kernel
from rocm_k3.triton_kernels.kda.chunk_solve import chunk_solve_kernel
from rocm_k3.triton_kernels.kda.chunk_state import chunk_state_kernel
from rocm_k3.triton_kernels.kda.common import CHUNK, is_pow2, plan_chunks

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 128  # the chunk tiles hold whole [16 or 64, K] rows and [K, BV] state slices in registers
# Output inside the sequential state walk (False) or in a separate parallel launch (True); see chunk_output.
SPLIT_OUTPUT = False
# num_warps of the parallel phases (the state walk's come from state_tile). H200 sweep at H = 96, T = 4096
# (2026-11-29, one knob at a time from prep 8 / intra 4 / solve 4, run-to-run spread ~5%): prep 16 and solve 2
# each took ~0.15-0.2 ms off a 2.1 ms call; intra 2 and 8 were slower. "prep_split": the column-split prep that
# normalises q, k (NORMS_IN_INTRA off); "prep_gate": the column-split prep that only gates and sums (NORMS_IN_INTRA,
# the default), at 4 warps instead of 8 since H100 2026-12-06 (session 24, RESULTS.md): end to end 1.034 / 4.009 /
# 16.29 / 3.930 ms against 1.081 / 4.281 / 17.00 / 4.198 at T = 4k / 16k / 64k / varlen 16k (o bit-equal; the kernel
# 0.209 -> 0.156 ms at 4k). The norm-taking prep was slower at 4 warps (kernel sum 1.534 vs 1.483 ms at 4k with
# 16-column slices, session 21).
# Session 28 (H100, RESULTS.md): the gate-only prep at 1 warp (sm_90: 30 thread-instructions per element instead of 52,
# 128 registers, no spills) took the call end to end from 0.960 / 3.758 / 15.30 / 3.673 to 0.947 / 3.697 / 15.23 /
# 3.600 ms at T = 4k / 16k / 64k / varlen 16k (o bit-equal; 2 warps: -1 to +0.4 %, BK 64 or BK 16 at 1 warp: no gain).
PHASE_WARPS = {"prep": 16, "prep_split": 8, "prep_gate": 1, "intra": 4, "solve": 1}
# Register cap per thread of chunk_intra with bf16 dots on NVIDIA (Triton's maxnreg; None: ptxas's choice; not
# passed on ROCm, nor for fp16 / fp32 activations, whose fp32-dot build spills 656 bytes uncapped and 1352 at 128).
# sm_90 cross-compile of the default intra kernel: 172-174 registers uncapped (two 4-warp programs per SM by registers); 168
# fits three (8 bytes spilled), 128 four (24 bytes spilled), 96 five (256 bytes). H100 2026-12-06 (session 25,
# RESULTS.md): the cap of 128 took the intra kernel from 0.502 to 0.444 ms at T = 4k, H = 96 and the call end to end
# from 1.030 / 4.047 / 16.40 / 3.968 to 0.971 / 3.755 / 15.32 / 3.676 ms at 4k / 16k / 64k / varlen 16k (o bit-equal);
# 168 gained ~1 %, 96 / 80 lost 25 % / 76 % at 4k (spills). Measured and dropped in the same session: the intra
# phase as one program per (chunk, head) walking its four sub-blocks (each row of q, k, G read once, no re-reads of
# earlier sub-blocks): 255 registers on sm_90 (the carried column operands), 1.30 / 5.00 / 20.2 ms end to end at 4k /
# 16k / 64k (4 warps; 1.26 / 4.84 / 19.5 capped at 168; 8 warps 1.52 / 5.91 / 24.0) against 0.976 / 3.789 / 15.40.
INTRA_MAXNREG: int | None = 128
# Column block of chunk_solve's programs (one per (chunk, head, BD columns of [W | U])). H200 2026-12-04 (session
# 16, RESULTS.md): BD 64 / 1 warp (202 registers, 10 programs per SM) solve 0.507 / 1.445 ms at T = 4k / 16k, H = 96,
# against one program per (chunk, head) at 2 warps 0.506 / 2.02 ms; BD 32 / 1 warp 0.886 / 3.51, BD 128 / 2 warps
# 0.549 / 2.13. The FlyDSL twin has no separate solve: it follows SOLVE_IN_WALK (kda_chunk_intra inverts the
# diagonal blocks, kda_chunk_state substitutes).
SOLVE_BD = 64
# Column slice of chunk_prep's [64, BK] tiles. H200 2026-12-04: BK = 128 (92 registers at 16 warps, one program
# per SM) was 8-12 % slower end to end than 32 (64 registers, two per SM) at T = 4k-64k.
PREP_BK = 32
# num_stages of the state walk (2: chunk c + 1's dot operands are fetched by cp.async during chunk c's products);
# None: state_stages' choice. sm_90 cross-compile: BV 64 / 8 warps holds 192 registers and 147 KB of shared memory
# at 2 stages (one program per SM: 192 walks of K3 run in two waves on 132 SMs); BV 64 / 4 warps / 1 stage fits two
# per SM and was 1.06-1.11x faster end to end at T = 4k-64k and on varlen batches (H200, 2026-12-04, RESULTS.md).
STATE_STAGES: int | None = None
# chunk_prep as one program per (chunk, PREP_BK-column slice, head) at PHASE_WARPS["prep_split"] / ["prep_gate"]
# warps (True) or one per (chunk, head) walking the slices at PHASE_WARPS["prep"] (False). H200 2026-12-04 (session
# 16, RESULTS.md), H = 96: split at 8 warps 0.434 / 1.718 ms at T = 4k / 16k against 0.456 / 1.848 unsplit at 16
# warps (split at 4 warps: equal to unsplit).
PREP_SPLIT = True
# chunk_intra writes KB = b * exp(G) * k' (activation dtype) and chunk_solve reads it as W's right-hand side instead
# of k' and fp32 G (2 bytes per element instead of 6, 147 registers instead of 202 on sm_90). H200 2026-12-04:
# solve 0.421 / 1.638 ms vs 0.507 / 2.021, intra +0.037 / +0.135 ms, outputs unchanged (relative error 0 / 1e-6).
# Measured and dropped in the same call: A in bf16 (solve 2x slower), the solve's column blocks first in the grid
# (+11 %).
SOLVE_KB = True
# chunk_intra inverts its diagonal 16 x 16 block of A (it holds it in registers) and stores T_II = (I + A_II)^-1 in
# its place; chunk_solve then loads T_II instead of inverting all four blocks in each of its K / BD + V / BD programs
# per (chunk, head) (4x the inversions at BD 64, 15 dependent row steps each). Off: H100 2026-12-05 (session 18,
# RESULTS.md) chunk_intra 0.343 -> 0.701 ms, solve 0.433 -> 0.270 at T = 4096, H = 96 (1.72 vs 1.53 ms in all).
INTRA_INVERTS = False
# The WY solve inside the state walk (chunk_state's SOLVE_IN): V' = U - W S = (I + A)^-1 (b v - KB S), so the walk forms
# b v - KB S per chunk and runs the block substitution itself; no chunk_solve launch, no W / U written and read back (at
# K = V = 128: 1 KB per token and head less). The intra kernel then writes KB and the diagonal inverses whatever
# SOLVE_KB / INTRA_INVERTS say. On (three launches) with INVERT_BY_PRODUCTS and the walk at SOLVE_WALK_STAGES = 2: H100
# 2026-12-05 (session 19, RESULTS.md) kernel sum 1.287 / 5.084 ms at T = 4k / 16k, H = 96, against 1.536 / 6.072 for the
# four launches (intra 0.455 ms with its inverses, walk 0.388 where solve + walk took 0.745). Session 18: with
# row-by-row inverses the intra kernel took 0.70 ms, and the walk at 1 stage 1.33 (spilling).
SOLVE_IN_WALK = True
# How the 16 x 16 diagonal blocks (I + A_II) are inverted wherever chunk_solve or chunk_intra invert them: row by row
# (False: 15 dependent steps of two cross-thread reductions each) or as the product (I - A)(I + A^2)(I + A^4)(I + A^8)
# (True: six fp32 16 x 16 x 16 products, four dependent levels). H100 2026-12-05 (session 19, RESULTS.md), T = 4096, H =
# 96: the intra kernel with its inverses 0.455 ms by products against 0.704 row by row (0.344 without them);
# chunk_solve's own inversion is slower by products (0.506 vs 0.435 ms), but with SOLVE_IN_WALK on chunk_solve does not
# run.
# Only with bf16 dots (invert_by_products): the products' intermediate powers grow like binomials when keys are
# strongly correlated (|A^8| ~3e3 at b ~1, near-identical keys, weak decay) and cancel back to O(1), which leaves
# ~1e-4 relative error in fp32 (row by row: ~1e-7; measured on the CPU in session 20), below bf16's rounding but not
# fp32's: fp16 / fp32 activations invert row by row.
INVERT_BY_PRODUCTS = True
# num_stages of the walk that solves (SOLVE_IN_WALK) when STATE_STAGES is None. H100 2026-12-05 (session 18): 1.33 ms
# at 1 stage (spilling), 0.39 ms at 2 (BV 64, 4 warps, T = 4096, H = 96); the default walk stays at 1 (2 stages:
# 0.31 -> 0.40 ms, session 19).
SOLVE_WALK_STAGES = 2
# chunk_prep only gates and sums (G, GL, b: no q or k read, no norm pass that re-reads every full q and k row once per
# column slice); chunk_intra computes the row norms from the full raw q, k rows it loads anyway (in place, at their row
# strides) and writes QG and KD for its own rows besides A, Aqk and KB. At K = 128 in bf16, of ~5.6 KB of HBM traffic
# per token and head over the three launches: 1.5 KB less at the prep, 0.5 KB more at the intra kernel, so ~4.6 KB.
# Needs the intra kernel's KB (SOLVE_KB or SOLVE_IN_WALK). On: H100 2026-12-05 (session 21, RESULTS.md), H = 96,
# kernel sum with BAND_IN_DOT_DTYPE 1.084 / 4.333 / 4.240 ms at T = 4k / 16k / varlen 16k against 1.297 / 5.136 /
# 5.042 without either (alone: 1.106 / 4.360 / 4.264); prep 0.21 ms instead of 0.44 at 4k, intra 0.50 instead of 0.46.
# Measured and dropped in the same call: the half-way step (the prep writing row factors, the intra kernel scaling the
# raw rows: 1.275 ms at 4k).
NORMS_IN_INTRA = True
# With SOLVE_IN_WALK, the [T, H, 64] A band (and its diagonal inverses) stored in the dot dtype (bf16 for bf16
# activations) instead of fp32: the walk rounds every A block to its dot operands anyway, so the outputs are the same
# and 128 bytes per token and head are neither written nor read. fp16 / fp32 activations keep an fp32 band (their
# dots are fp32). On: H100 2026-12-05 (session 21): 1.251 / 4.973 ms at T = 4k / 16k alone against 1.297 / 5.136; with
# NORMS_IN_INTRA 1.084 / 4.333 against 1.106 / 4.360 (the walk's sm_90 build spills 128 B at 255 registers with it).
BAND_IN_DOT_DTYPE = True
# The prep's and the intra kernel's exponentials as exp2(x log2 e) (common.exp_f32's FAST form: tl.exp without its
# denormal-range fix-up, a compare, a select and a multiply per call on sm_90; results below 2^-126 flush to 0), and
# the prep's sigmoids with the reciprocal as rsqrt(1 + e)^2 (common.sigmoid_f32's). sm_90 cross-compile (Triton 3.9,
# instructions per thread): prep 960 -> 832, intra 2,176 -> 1,936; gfx942: 709 -> 532, 1,820 -> 1,528. On: H100
# 2026-12-06 (session 27, RESULTS.md) end to end 0.966 / 3.733 / 15.25 / 3.655 ms against 0.977 / 3.799 / 15.44 /
# 3.728 at T = 4k / 16k / 64k / varlen 16k (o 2.6e-4 off the exact-exp build, bf16 level).
FAST_EXP = True
# With NORMS_IN_INTRA and the walk that solves, for bf16 dots: chunk_prep writes the sub-block decay factors E = exp(G -
# G_m) in bf16 (G_m: the midpoint of each 16-row sub-block's G range, chunk_intra's reference) and G_m / G_last fp32 per
# chunk ([NC, H, 5, K]) instead of fp32 G [T, H, K]: 0.5 KB per token and head less between the two (of ~4.9 KB
# measured, session 26), and the intra kernel forms its factors by products (one exponential per column and
# sub-block, one reciprocal per element) instead of exponentials per element. E carries bf16's 8 mantissa bits
# into factors that the dots round to bf16 anyway. fp16 / fp32 activations keep fp32 G (their dots are fp32). On: H200
# 2026-12-06 (session 29, RESULTS.md), end to end 0.850 / 3.324 / 13.53 / 3.270 ms against 0.905 / 3.519 / 14.35 / 3.467
# at T = 4k / 16k / 64k / varlen 16k (-5.5 to -6.1 %; the prep at 2 warps with it: slower); sm_90 cross-compile, per
# thread: intra 1,920 -> 1,856 instructions (80 -> 17 ex2, 32 rsqrt), 32 -> 8 bytes spilled at its cap; prep 1,936 ->
# 1,992 (the exponential per element it gains).
GATE_FACTORS = True

# With SOLVE_IN_WALK and bf16 dots: the walk's step solves with whole-chunk products instead of the block substitution
# on 16-row tiles (chunk_state's HORNER: Y = T_D (b v - KB S), V' = (I - L)(I + L^2) Y with L = T_D N; chunk_intra
# stores -L_IJ = -T_II A_IJ in the band's blocks below the diagonal, NEG_L, in place of A_IJ): the dependent chain is
# KB S, T_D X, L^2 Y, -L W, KD^T V' ([64, 64] x [64, BV] products; L^2 = (-L)(-L) is formed off the state's chain)
# instead of ten dependent [16, *] products, the chunk's tiles loaded whole. bf16 dots only: the series is exact (L^4
# = 0) but its products round differently from the substitution, and fp32 dots keep the substitution's accuracy.
# At HORNER_WALK_STAGES stages: the sm_90 build holds 65 KB of shared memory at 1 stage and 172 KB at 2 (one program
# per SM).
WALK_HORNER = False
HORNER_WALK_STAGES = 1


def walk_horner(dot_t: tl.dtype, solve_in: bool) -> bool:
    """Whether the state walk solves by chunk_state's HORNER products (WALK_HORNER, bf16 dots, the walk solving)."""
    return WALK_HORNER and dot_t == tl.bfloat16 and solve_in


def gate_factors(dot_t: tl.dtype, norms_in: bool, solve_in: bool) -> bool:
    """Whether chunk_prep writes GATE_FACTORS' E and G_m (bf16 dots, the prep gating only, the walk solving)."""
    return GATE_FACTORS and dot_t == tl.bfloat16 and norms_in and solve_in


def dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) of the kernels' ``tl.dot`` calls for activations of ``dtype``.

    bf16 activations use bf16 operands (fp32 accumulation); fp16 and fp32 use fp32 operands in IEEE precision
    (fp16 cannot hold the sub-block decay factors, see chunk_intra).
    """
    if dtype == torch.bfloat16:
        return tl.bfloat16, "ieee"
    return tl.float32, "ieee"


def invert_by_products(dot_t: tl.dtype) -> bool:
    """Whether the diagonal blocks are inverted by products: INVERT_BY_PRODUCTS with bf16 dots (see there)."""
    return INVERT_BY_PRODUCTS and dot_t == tl.bfloat16


def band_dtype(dot_t: tl.dtype, solve_in: bool) -> torch.dtype:
    """dtype of the [T, H, 64] A band: the dot dtype (bf16) when BAND_IN_DOT_DTYPE and the walk solves with bf16
    dots, else fp32 (chunk_solve inverts and substitutes from it in fp32)."""
    if BAND_IN_DOT_DTYPE and solve_in and dot_t == tl.bfloat16:
        return torch.bfloat16
    return torch.float32


def register_cap(maxnreg: int | None) -> dict:
    """Launch options capping a kernel's registers per thread at ``maxnreg`` on NVIDIA (none when None or on ROCm,
    whose Triton backend has no such option)."""
    if maxnreg is None:
        return {}
    if not isinstance(maxnreg, int) or isinstance(maxnreg, bool):
        raise TypeError(f"a register cap must be an int, got {type(maxnreg).__name__}")
    if not 24 <= maxnreg <= 255:
        raise ValueError(f"a register cap must lie in [24, 255], got {maxnreg}")
    return {} if torch.version.hip is not None else {"maxnreg": maxnreg}


def state_tile(n_seq_heads: int, V: int) -> tuple[int, int]:
    """(value block BV, num_warps) of the state phase for ``n_seq_heads`` = N * H sequential walks.

    Measured on the H200: BV = 64 is fastest once there are >= 96 (walk, value block) programs, with 4 warps and
    one stage (two programs per SM; 2026-12-04: 1.75 / 6.47 / 26.1 ms at T = 4k / 16k / 64k, H = 96, against 1.93 /
    7.14 / 28.8 with 8 warps and two stages); a lone TP-8 sequence (12 heads) is faster with BV = 16 and 4 warps
    (2026-11-29).
    """
    if V >= 64 and n_seq_heads * (V // 64) >= 96:
        return 64, 4
    return min(16, V), 4


def state_stages(bv: int, solve_in: bool = False, horner: bool = False) -> int:
    """num_stages of the state walk for value block ``bv``: ``STATE_STAGES`` when set; else, for the walk that solves
    by HORNER's products (``horner``, WALK_HORNER), ``HORNER_WALK_STAGES``; for the walk that substitutes
    (``solve_in``, SOLVE_IN_WALK), ``SOLVE_WALK_STAGES``; else 1 for BV 64 (two programs per SM, measured faster)
    and 2 below it (as timed on 2026-11-29)."""
    if STATE_STAGES is not None:
        return STATE_STAGES
    if horner:
        return HORNER_WALK_STAGES
    if solve_in:
        return SOLVE_WALK_STAGES
    return 1 if bv >= 64 else 2


def supports_kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         cu_seqlens: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                         has_initial_state: torch.Tensor, *, scale: float | None = None,
                         gate_params: KDAGateParams | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
                         intermediate_positions: torch.Tensor | None = None) -> tuple[bool, str]:
    """(ok, reason): head dims powers of two in [16, 128], one activation dtype, fp32 contiguous state,
    intermediate positions at chunk ends (p % 64 == 0)."""
    K, V = q.shape[-1], v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if not (is_pow2(d) and 16 <= d <= MAX_HEAD_DIM):
            return False, f"triton kda_prefill needs {name} a power of two in [16, {MAX_HEAD_DIM}], got {d}"
    if q.dtype not in _ACT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, f"triton kda_prefill needs q, k, v of one dtype in {_ACT_DTYPES}, got {q.dtype}/{k.dtype}/{v.dtype}"
    if state.dtype != torch.float32 or not state.is_contiguous():
        return False, "triton kda_prefill updates the state in place: it must be contiguous fp32"
    if intermediate_positions is not None and intermediate_positions.numel() > 0:
        p = intermediate_positions[:, 1]
        if bool((p % CHUNK != 0).any()):
            bad = p[p % CHUNK != 0][:4].tolist()
            return False, f"triton kda_prefill saves states at chunk ends only (p % {CHUNK} == 0); got p = {bad}"
    return True, "supported"


def _row_strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` [T, H, D] itself when the kernels can read it in place (element stride 1, head stride D, any token-row
    stride: a column slice of a [T, n * H * D] tensor), else a contiguous copy."""
    H, D = t.shape[1], t.shape[2]
    if t.stride(2) == 1 and (H == 1 or t.stride(1) == D):
        return t
    return t.contiguous()


def _inter_map(positions: torch.Tensor, seq_first_chunk: torch.Tensor, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int32 [NC] chunk -> row of the intermediate buffer (-1: none), and, when two rows ask for the same state,
    the row each one copies from afterwards."""
    pos = positions.to(torch.int64)
    gid = seq_first_chunk.to(torch.int64)[pos[:, 0]] + pos[:, 1] // CHUNK - 1  # [M] chunk after which to save
    rows = torch.arange(pos.shape[0], device=pos.device)
    inter_map = torch.full((num_chunks,), -1, dtype=torch.int32, device=pos.device)
    inter_map[gid] = rows.to(torch.int32)
    source = inter_map[gid].to(torch.int64)
    return inter_map, (None if bool((source == rows).all()) else source)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor, *, scale: float | None = None,
                gate_params: KDAGateParams | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
                intermediate_positions: torch.Tensor | None = None) -> KDAPrefillOutput:
    """Chunked KDA prefill (see module docstring); q, k [T, H, K], v [T, H, V], g [T, H, K], beta [T, H],
    state fp32 [S, H, K, V] updated in place at ``state_indices``. Returns (o [T, H, V] in v's dtype,
    intermediate states fp32 [M, H, K, V] or None)."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.shape[0] - 1
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    q, k, v = (_row_strided(t) for t in (q, k, v))  # column views of the short conv's output: no copy
    g, beta = g.contiguous(), beta.contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    plan = plan_chunks(cu, T)
    o = torch.empty(T, H, V, dtype=v.dtype, device=dev)
    has_inter = intermediate_positions is not None and intermediate_positions.shape[0] > 0
    inter = None
    if has_inter:
        inter = torch.empty(intermediate_positions.shape[0], H, K, V, dtype=torch.float32, device=dev)
    if plan.num_chunks == 0:  # only empty sequences: the final state is the initial one
        fresh = state_indices[~has_initial_state.bool()].long()
        state[fresh] = 0.0
        return KDAPrefillOutput(o, inter)

    dot_t, prec = dot_config(q.dtype)
    mid_dtype = q.dtype  # q', k', QG, KD, W, U, Aqk travel in the activation dtype

    def buf(*shape: int, dtype: torch.dtype = mid_dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=dev)

    if gate_params is not None:
        a_log, dt_bias = gate_params.A_log.float().contiguous(), gate_params.dt_bias.float().contiguous()
        lower = gate_params.lower_bound
    else:
        a_log, dt_bias, lower = o, o, None  # unread placeholders
    flags = dict(HAS_GATE=gate_params is not None, SAFE_GATE=lower is not None, QK_NORM=qk_l2norm,
                 BETA_LOGITS=beta_logits)
    lower = 0.0 if lower is None else float(lower)
    solve_in = SOLVE_IN_WALK
    horner = walk_horner(dot_t, solve_in)  # the intra kernel's NEG_L band and the walk's HORNER go together
    qg, kd = buf(T, H, K), buf(T, H, K)
    w, u = (o, o) if solve_in else (buf(T, H, K), buf(T, H, V))  # o: unread placeholders (the walk solves)
    glast = buf(plan.num_chunks, H, K, dtype=torch.float32)
    aqk = buf(T, H, CHUNK)
    walk_in = _three_phases(q, k, v, g, beta, a_log, dt_bias, lower, flags, scale, plan, cu, qg, kd, glast, aqk,
                            w, u, dot_t, prec, solve_in, horner) or (o, o, o)  # (A band, KB, b) when the walk solves

    inter_map, copy_from = (None, None)
    if has_inter:
        inter_map, copy_from = _inter_map(intermediate_positions, plan.seq_first_chunk, plan.num_chunks)
    bv, warps = state_tile(N * H, V)
    split = SPLIT_OUTPUT
    hbuf = buf(plan.num_chunks, H, K, V) if split else o  # o: an unread placeholder
    vbuf = buf(T, H, V) if split else o
    chunk_state_kernel[(V // bv, N, H)](
        w, u, qg, kd, aqk, glast, cu, plan.seq_first_chunk,
        state, state_indices.to(torch.int32).contiguous(), has_initial_state.to(torch.int8).contiguous(),
        o, inter if has_inter else o, inter_map if has_inter else cu, hbuf, vbuf,
        walk_in[0], walk_in[1], v, walk_in[2], v.stride(0),
        H=H, K=K, V=V, BV=bv, HAS_INTER=has_inter, WITH_OUTPUT=not split, DOT_T=dot_t, PREC=prec, SOLVE_IN=solve_in,
        HORNER=horner, num_warps=warps, num_stages=state_stages(bv, solve_in, horner),
    )
    if split:
        bvo = min(64, V)
        chunk_output_kernel[(plan.num_chunks, H, V // bvo)](
            qg, aqk, hbuf, vbuf, plan.chunk_seq, plan.chunk_start, cu, o,
            H=H, K=K, V=V, BV=bvo, DOT_T=dot_t, PREC=prec, num_warps=4,
        )
    if copy_from is not None:
        inter = inter[copy_from]
    return KDAPrefillOutput(o, inter)


def _three_phases(q, k, v, g, beta, a_log, dt_bias, lower, flags, scale, plan, cu, qg, kd, glast, aqk, w, u,
                  dot_t, prec, solve_in: bool, horner: bool = False) -> tuple | None:
    """Phases 1-3 as three launches (prep, intra, solve); writes qg, kd, glast, aqk, w, u. With ``solve_in``
    (``SOLVE_IN_WALK``) no solve runs: the intra kernel writes KB and the diagonal inverses, and (A band, KB, b) are
    returned for the state walk; with ``horner`` (``walk_horner``) the band holds -L below the diagonal (NEG_L)."""
    T, H, K = q.shape

    def buf(*shape: int, dtype: torch.dtype = q.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=q.device)

    b = buf(T, H, dtype=torch.float32)
    intra_grid = (plan.num_chunks * (CHUNK // 16), H)  # sub-block fastest (common.grid_ids)
    write_kb = SOLVE_KB or solve_in
    norms_in = NORMS_IN_INTRA and write_kb  # nothing else reads k' then
    # the intra kernel reads q and k in place and normalises them itself, or reads the prep's q', k'
    qn, kn = (q, k) if norms_in else (buf(T, H, K), buf(T, H, K))
    factors = gate_factors(dot_t, norms_in, solve_in)
    # G fp32, or (factors) E in the dot dtype and G_m / G_last per chunk
    gcum = buf(T, H, K, dtype=torch.bfloat16 if factors and dot_t == tl.bfloat16 else torch.float32)
    gref = buf(plan.num_chunks, H, 5, K, dtype=torch.float32) if factors else gcum  # gcum: an unread placeholder
    bk = min(PREP_BK, K)
    prep_grid = (plan.num_chunks * (K // bk), H) if PREP_SPLIT else (plan.num_chunks, H)  # slice fastest (grid_ids)
    chunk_prep_kernel[prep_grid](
        q, k, g, beta, a_log, dt_bias, plan.chunk_seq, plan.chunk_start, cu,
        qn, kn, gcum, b, qg, kd, glast, gref, scale, lower, q.stride(0), k.stride(0),
        H=H, K=K, BT=CHUNK, BK=bk, **flags, COL_SPLIT=PREP_SPLIT, GATE_ONLY=norms_in, FAST_EXP=FAST_EXP,
        FACTORS=factors,
        num_warps=PHASE_WARPS[("prep_gate" if norms_in else "prep_split") if PREP_SPLIT else "prep"], num_stages=1,
    )
    a = buf(T, H, CHUNK, dtype=band_dtype(dot_t, solve_in))
    kb = buf(T, H, K) if write_kb else kn  # without KB the solve reads k' (and G)
    chunk_intra_kernel[intra_grid](
        qn, kn, gcum, b, qn.stride(0), kn.stride(0), scale, plan.chunk_seq, plan.chunk_start, cu, a, aqk,
        kb, qg, kd, gref, H=H, K=K, DOT_T=dot_t, PREC=prec, WRITE_KB=write_kb,
        INVERT_DIAG=INTRA_INVERTS or solve_in, INVERT_PRODUCTS=invert_by_products(dot_t), RAW_QK=norms_in,
        QK_NORM=flags["QK_NORM"], FAST_EXP=FAST_EXP, FACTORS=factors, NEG_L=horner,
        num_warps=PHASE_WARPS["intra"], **register_cap(INTRA_MAXNREG if dot_t == tl.bfloat16 else None),
    )
    if solve_in:
        return a, kb, b
    _solve(a, kb, v, gcum, b, plan, cu, w, u, dot_t, prec, SOLVE_KB)
    return None


def _solve(a, kb, v, gcum, b, plan, cu, w, u, dot_t, prec, read_kb: bool) -> None:
    """Phase 3 (chunk_solve): W, U from A and KB (``read_kb``) or k' and G, v and b."""
    H, K = kb.shape[1], kb.shape[2]
    V = v.shape[-1]
    bd = min(SOLVE_BD, K, V)
    chunk_solve_kernel[(plan.num_chunks, H, K // bd + V // bd)](
        a, kb, v, gcum, b, plan.chunk_seq, plan.chunk_start, cu, w, u, v.stride(0),
        H=H, K=K, V=V, BD=bd, DOT_T=dot_t, PREC=prec, KB=read_kb, DIAG_INVERTED=INTRA_INVERTS,
        INVERT_PRODUCTS=invert_by_products(dot_t),
        num_warps=PHASE_WARPS["solve"], num_stages=1,
    )
