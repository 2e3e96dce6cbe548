"""``fused_moe`` on Triton: align -> [MXFP8 pre-pass] -> w13 GEMM + activation -> w2 GEMM x routing weight -> reduce.

Launches (decode, A16W4): the single-program align, the w13 GEMM, the w2 GEMM and the top-k reduce (4 in all;
A8W4 adds the x pre-pass). Every expert weight tile is read once per block of BM rows routed to it, so at
decode (T <= 64) the bytes moved are the active experts' weights.

Two GEMM families (:func:`pick_config`): at decode (T * top_k <= 1.5 E; K3: T <= 84) MXFP4 experts take the
FMA decode GEMV ("gemv_f16": one routed row per block, E2M1 pairs decoded through fp16 bit patterns, fp32
multiply-adds, no MMA, 1.7x faster than the MMA path at T = 1 on the H200); above that, and for bf16 experts,
the expert-sorted MMA tiles ("dot_scaled"). Both read the same weight bytes.

Weight layout (the choice: prepare lazily, once, and cache): the kernels read the checkpoint byte order
([E, 2N, K/2] packed along K, low nibble first, E8M0 [E, 2N, K/32]) directly, so "preparing" only means
contiguous tensors. :func:`prepare_weights` does that at load time and tags ``layout="triton"``; weights in any
other layout (``ExpertWeights`` always keeps valid checkpoint-layout tensors) are accepted too, and their
contiguous view is made on the first call and cached in ``weights.extras["triton"]`` (no copy when the tensors
are already contiguous, which is what the loader produces).

Precision: bf16/fp16 x feeds bf16 operands to the MMA (fp32 accumulation). fp32 x with ``act_quant="bf16"``
takes the fp32-operand path (``OP_F32`` in :mod:`.kernels`): x, the decoded weights and the fp32 intermediate
activation enter IEEE fp32 dots, so the result matches the fp32 reference up to summation order (an fp32 model
on this backend then follows the reference backend's greedy path). MXFP4 experts use the manual E2M1 decode
there (``dot_scaled`` only takes low-precision operands). A8W4 keeps its MXFP8 operands, which bf16 holds exactly.
"""

from __future__ import annotations

import dataclasses
import torch
import triton

from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.triton_kernels.moe import kernels as K
from rocm_k3.triton_kernels.moe.align import align_routing
from rocm_k3.triton_kernels.runtime import interpreted

LAYOUT = "triton"
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# E4M3 variants: (scale exponent offset EMAX, exponent bias, largest finite value)
_FP8 = {torch.float8_e4m3fn: (8, 7, 448.0), torch.float8_e4m3fnuz: (7, 8, 240.0)}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of both GEMMs: BM rows (tokens of one expert) x BN output columns x BK reduction.

    All are powers of two; BK >= 32 (one E8M0 group) and BN >= 32 (the A8W4 epilogue quantises BN columns in
    groups of 32). The MMA decodes ("dot_scaled", "manual", "bits") and bf16 experts further need BM >= 16 (the
    smallest MMA tile) and BK >= 64 (32 packed bytes per row for dot_scaled); the launcher checks that. The FMA
    decodes ("fma", "fma_f16") take any BM >= 1.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name, low in (("block_m", 1), ("block_n", 32), ("block_k", 32), ("num_warps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or value & (value - 1):
                raise ValueError(f"MoEConfig.{name} must be a power of two >= {low}, got {value!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"MoEConfig.num_stages must be an int >= 1, got {self.num_stages!r}")

    @property
    def mma_ok(self) -> bool:
        return self.block_m >= 16 and self.block_k >= 64


# MMA tiles keyed on how many rows each expert gets on average (bf16 experts, and MXFP4 past the FMA range).
# Measured on the H200 (Triton 3.6, 2026-11-29): (16, 32, 64, 4, 1) was the fastest correct MMA decode tile.
DECODE_CONFIG = MoEConfig(16, 32, 64, 4, 1)
PREFILL_CONFIG = MoEConfig(64, 128, 128, 8, 1)
# MXFP4 decode GEMV on fp32 multiply-adds: one routed row per block, 64 output columns x 128 K per step.
# H200, K3 experts (E 896, top-16), 2026-11-29: gemv_f16 1x64x128 w4 368 us at T = 1 vs 631 us for the MMA
# (dot_scaled) path, 5.3 ms vs 8.0 ms at T = 16; at T = 64 (1.14 pairs per expert) the GEMV tiles were still
# 1.1x faster, at T = 256 (4.6) the first FMA kernel was 2.5-3x slower than MMA. Crossover set at 1.5.
FMA_CONFIG = MoEConfig(1, 64, 128, 4, 1)
FMA_DECODE = "gemv_f16"
# from 1/4 pair per expert up (K3: T >= 14) 2-warp 64x64 steps were faster: T = 16 4.99 vs 5.34 ms, T = 64 19.2 vs
# 21.2 ms; at T = 1 / 4 they were slower (497 vs 368 us, 1.45 vs 1.38 ms). Same kernel, same sums per column.
FMA_WIDE_CONFIG = MoEConfig(1, 64, 64, 2, 1)
FMA_WIDE_MIN_PAIRS_PER_EXPERT = 0.25
FMA_MAX_PAIRS_PER_EXPERT = 1.5  # FMA path while T * top_k <= this * E (decode); MMA above
# A8W4: the GEMV decodes each MXFP8 activation per weight word (no bf16 pair loads), so the first FMA kernel is
# faster there: T = 1 486 us ("fma", 1x32x128) vs 842 us (gemv_f16); T = 64 MMA 32 ms vs gemv_f16 48 ms.
FMA_A8_CONFIG = MoEConfig(1, 32, 128, 4, 1)
FMA_A8_DECODE = "fma"
FMA_A8_MAX_PAIRS_PER_EXPERT = 1.0
# Triton 3.6 on sm_90 miscompiles a software-pipelined (num_stages > 1) tl.dot_scaled with this packed-rhs layout:
# outputs were uncorrelated with the reference (rel. error 1.41) while num_stages=1 and the manual decode were
# right (2.5e-3). The dot_scaled path is therefore always launched unpipelined.
_DOT_SCALED_MAX_STAGES = 1
_W4_DECODES = {"dot_scaled": K.W_MXFP4, "manual": K.W_MXFP4_MANUAL, "bits": K.W_MXFP4_BITS,
               "fma": K.W_MXFP4_FMA, "fma_f16": K.W_MXFP4_FMA, "gemv": K.W_MXFP4_GEMV,
               "gemv_f16": K.W_MXFP4_GEMV}
_FMA_DECODES = ("fma", "fma_f16", "gemv", "gemv_f16")


def pick_config(num_pairs: int, num_experts: int, fmt: str = "mxfp4",
                act_quant: str = "bf16") -> tuple[MoEConfig, str]:
    """(tiles, MXFP4 decode) for a routing of ``num_pairs`` (token, slot) pairs over ``num_experts`` experts."""
    if fmt == "mxfp4" and act_quant == "mxfp8" and num_pairs <= FMA_A8_MAX_PAIRS_PER_EXPERT * num_experts:
        return FMA_A8_CONFIG, FMA_A8_DECODE
    if fmt == "mxfp4" and act_quant != "mxfp8" and num_pairs <= FMA_MAX_PAIRS_PER_EXPERT * num_experts:
        wide = num_pairs >= FMA_WIDE_MIN_PAIRS_PER_EXPERT * num_experts
        return (FMA_WIDE_CONFIG if wide else FMA_CONFIG), FMA_DECODE
    return (DECODE_CONFIG if num_pairs <= 4 * num_experts else PREFILL_CONFIG), "dot_scaled"


def _resolve(config: MoEConfig | None, w4_decode: str | None, num_pairs: int, num_experts: int,
             fmt: str, act_quant: str) -> tuple[MoEConfig, str]:
    """The (tiles, decode) a call runs with: what was asked for, the rest from :func:`pick_config`."""
    if config is not None:
        return config, w4_decode or ("dot_scaled" if config.mma_ok else FMA_DECODE)
    if w4_decode in _FMA_DECODES:
        return (FMA_CONFIG if w4_decode.startswith("gemv") else FMA_A8_CONFIG), w4_decode
    picked, decode = pick_config(num_pairs, num_experts, fmt, act_quant)
    if w4_decode is None:
        return picked, decode
    return (picked if picked.mma_ok else pick_config(num_pairs, num_experts, "bf16")[0]), w4_decode


def _contiguous(weights: ExpertWeights) -> tuple[torch.Tensor | None, ...]:
    """(w13, w13_scale, w2, w2_scale), each contiguous (the same tensor when it already is)."""
    return tuple(None if t is None else t.contiguous()
                 for t in (weights.w13, weights.w13_scale, weights.w2, weights.w2_scale))


def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
    """Experts in checkpoint layout -> the same weights, contiguous, tagged ``layout="triton"`` (idempotent).

    Another backend's ``extras`` are dropped (its checkpoint-layout tensors are what this backend reads).
    """
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    if weights.layout == LAYOUT:
        return weights
    w13, w13s, w2, w2s = _contiguous(weights)
    return dataclasses.replace(weights, w13=w13, w13_scale=w13s, w2=w2, w2_scale=w2s, layout=LAYOUT, extras={})


def _kernel_weights(weights: ExpertWeights) -> tuple[torch.Tensor | None, ...]:
    """The tensors the kernels read: prepared weights as they are, others made contiguous once and cached."""
    if weights.layout == LAYOUT:
        return weights.w13, weights.w13_scale, weights.w2, weights.w2_scale
    cached = weights.extras.get(LAYOUT)
    if cached is None:
        cached = _contiguous(weights)
        weights.extras[LAYOUT] = cached  # extras is the backend-private cache of ExpertWeights
    return cached


def fused_moe_supports(x, weights, topk_weights, topk_ids, *, activation=MoEActivation(), act_quant="bf16",
                       fp8_dtype=None) -> tuple[bool, str]:
    if x.dtype not in _ACT_DTYPES:
        return False, f"x must be bf16/fp16/fp32, got {x.dtype}"
    if act_quant == "mxfp8" and fp8_dtype not in _FP8:
        return False, f"act_quant='mxfp8' needs fp8_dtype float8_e4m3fn or float8_e4m3fnuz, got {fp8_dtype!r}"
    if weights.fmt == "bf16" and act_quant == "mxfp8":
        return False, "A8W4 (act_quant='mxfp8') is only implemented for MXFP4 experts"
    if weights.intermediate % 32:
        return False, f"intermediate size {weights.intermediate} must be a multiple of 32"
    return True, "supported"


def _mxfp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (E4M3 code bytes uint8 [R, K], E8M0 uint8 [R, K/32]) with the ct rule."""
    emax, bias, fmax = _FP8[fp8_dtype]
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(rows, k // 32, dtype=torch.uint8, device=x.device)
    if rows:
        block_k = min(256, triton.next_power_of_2(k))
        K.mxfp8_quant_kernel[(triton.cdiv(rows, 4), triton.cdiv(k, block_k))](
            x, q, s, rows, k, x.stride(0), q.stride(0), s.stride(0),
            EMAX=emax, BIAS=bias, FP8_MAX=fmax, ROWS=4, BLOCK_K=block_k,
        )
    return q, s


def fused_moe(x: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              activation: MoEActivation = MoEActivation(), act_quant: str = "bf16",
              fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * W2_e act(W13_e x_t)`` -> [T, Kout] in x dtype (see module doc)."""
    return fused_moe_with(x, weights, topk_weights, topk_ids, activation=activation, act_quant=act_quant,
                          fp8_dtype=fp8_dtype)


def fused_moe_with(x, weights, topk_weights, topk_ids, *, activation=MoEActivation(), act_quant="bf16",
                   fp8_dtype=None, config: MoEConfig | None = None, manual_w4: bool = False,
                   w4_decode: str | None = None) -> torch.Tensor:
    """:func:`fused_moe` with an explicit tile config and MXFP4 decode (benchmarks, tests).

    w4_decode (None: :func:`pick_config`'s choice): "dot_scaled" (Triton's scaled dot), "manual" (arithmetic
    E2M1 decode + tl.dot), "bits" (fp32 bit-pattern decode + even/odd split + tl.dot), "fma" (the bits decode
    on fp32 multiply-adds, no MMA: the decode GEMV) or "fma_f16" (the same with an fp16 bit-pattern decode).
    ``manual_w4=True`` is the same as ``w4_decode="manual"``. With fp32 x and ``act_quant="bf16"`` the MMA
    paths take fp32 operands and "dot_scaled" becomes "manual"; the FMA paths are fp32 throughout anyway.
    All decodes but dot_scaled are exact over the whole E8M0 range; Triton's dot_scaled was seen to give NaN
    (interpreter) for scale bytes >= ~140, far above checkpoint scales (< 127).
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig or None, got {type(config).__name__}")
    if w4_decode is not None and w4_decode not in _W4_DECODES:
        raise ValueError(f"w4_decode must be one of {sorted(_W4_DECODES)}, got {w4_decode!r}")
    if manual_w4:
        w4_decode = "manual"
    tokens, top_k = topk_ids.shape
    num_experts, n, hidden, kout = weights.num_experts, weights.intermediate, weights.hidden, weights.out_features
    out = torch.empty(tokens, kout, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    cfg, w4_decode = _resolve(config, w4_decode, tokens * top_k, num_experts, weights.fmt, act_quant)
    fma = weights.fmt == "mxfp4" and w4_decode in _FMA_DECODES
    if not fma and not cfg.mma_ok:
        raise ValueError(f"MoEConfig{dataclasses.astuple(cfg)}: the MMA paths need block_m >= 16 and block_k >= 64 "
                         f"(only the 'fma' decodes of MXFP4 experts take smaller tiles)")
    if w4_decode in ("gemv", "gemv_f16") and cfg.block_m != 1:
        raise ValueError(f"the '{w4_decode}' decode runs one routed row per block: block_m must be 1, got {cfg.block_m}")
    routing = align_routing(topk_ids, num_experts, cfg.block_m)
    num_blocks = routing.block_expert.numel()
    padded_rows = routing.sorted_pairs.numel()
    a8 = act_quant == "mxfp8"
    emax, bias, fmax = _FP8.get(fp8_dtype, (8, 7, 448.0))
    w_fmt = K.W_BF16 if weights.fmt == "bf16" else _W4_DECODES[w4_decode]
    op_f32 = x.dtype == torch.float32 and not a8  # fp32 operands, IEEE dots (module doc)
    if op_f32 and w_fmt == K.W_MXFP4:
        w_fmt = K.W_MXFP4_MANUAL
    x = x if x.stride(-1) == 1 else x.contiguous()
    if a8:
        xa, xs = _mxfp8_quantize(x, fp8_dtype)
        inter = torch.empty(padded_rows, n, dtype=torch.uint8, device=x.device)  # E4M3 codes
        inter_s = torch.empty(padded_rows, n // 32, dtype=torch.uint8, device=x.device)
    else:
        xa, xs = x, x
        inter = torch.empty(padded_rows, n, dtype=x.dtype, device=x.device)
        inter_s = inter
    w13, w13s, w2, w2s = _kernel_weights(weights)
    w13s = w13s if w13s is not None else w13  # bf16 experts: the scale pointers are unused
    w2s = w2s if w2s is not None else w2
    linear_beta = activation.linear_beta
    stages = min(cfg.num_stages, _DOT_SCALED_MAX_STAGES) if w_fmt == K.W_MXFP4 else cfg.num_stages
    common = dict(A_MX=a8, W_FMT=w_fmt, OP_F32=op_f32, DOT_F32=interpreted(K.w13_kernel), BIAS=bias,
                  F16_DECODE=w4_decode in ("fma_f16", "gemv_f16"),
                  BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.num_warps, num_stages=stages)
    K.w13_kernel[(num_blocks, triton.cdiv(n, cfg.block_n))](
        xa, xs, w13, w13s, inter, inter_s,
        routing.sorted_pairs, routing.block_expert, routing.expert_start, routing.expert_count,
        hidden, n, top_k, xa.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0), w13s.stride(1),
        inter.stride(0), inter_s.stride(0), float(activation.beta), float(linear_beta or 1.0),
        ACT=K.ACT_SITU if activation.kind == "situ" else K.ACT_SILU, HAS_LINEAR_BETA=linear_beta is not None,
        OUT_MX=a8, EMAX=emax, FP8_MAX=fmax, **common,
    )
    y = torch.empty(tokens * top_k, kout, dtype=torch.float32, device=x.device)  # per-pair weighted outputs
    tw = topk_weights.reshape(-1).to(torch.float32)
    K.w2_kernel[(num_blocks, triton.cdiv(kout, cfg.block_n))](
        inter, inter_s, w2, w2s, y, tw,
        routing.sorted_pairs, routing.block_expert, routing.expert_start, routing.expert_count,
        n, kout, inter.stride(0), inter_s.stride(0), w2.stride(0), w2.stride(1), w2s.stride(0), w2s.stride(1),
        y.stride(0), **common,
    )
    block = min(1024, triton.next_power_of_2(kout))
    K.topk_reduce_kernel[(tokens, triton.cdiv(kout, block))](
        y, out, kout, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
    )
    return out
