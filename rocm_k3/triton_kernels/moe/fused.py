"""``fused_moe`` on Triton: align -> [MXFP8 pre-pass] -> w13 GEMM + activation -> w2 GEMM x routing weight -> reduce.

Launches (decode, A16W4): the single-program align, the w13 GEMM, the w2 GEMM and the top-k reduce (4 in all;
A8W4 adds the x pre-pass). Every expert weight tile is read once per block of BM rows routed to it, so at
decode (T <= 64) the bytes moved are the active experts' weights.

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

    All are powers of two; BM >= 16 (the smallest MMA tile), BN and BK multiples of 32 (one E8M0 group; the
    A8W4 epilogue quantises BN columns in groups of 32), BK >= 64 (32 packed bytes per row for dot_scaled).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name, low in (("block_m", 16), ("block_n", 32), ("block_k", 64), ("num_warps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or value & (value - 1):
                raise ValueError(f"MoEConfig.{name} must be a power of two >= {low}, got {value!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"MoEConfig.num_stages must be an int >= 1, got {self.num_stages!r}")


# Keyed on how many rows each expert gets on average: decode (few) vs prefill (many). Measured on the H200
# (Triton 3.6, 2026-11-29): (16, 32, 64, 4, 1) was the fastest correct decode tile (benchmarks/RESULTS.md).
DECODE_CONFIG = MoEConfig(16, 32, 64, 4, 1)
PREFILL_CONFIG = MoEConfig(64, 128, 128, 8, 1)
# Triton 3.6 on sm_90 miscompiles a software-pipelined (num_stages > 1) tl.dot_scaled with this packed-rhs layout:
# outputs were uncorrelated with the reference (rel. error 1.41) while num_stages=1 and the manual decode were
# right (2.5e-3). The dot_scaled path is therefore always launched unpipelined.
_DOT_SCALED_MAX_STAGES = 1
_W4_DECODES = {"dot_scaled": K.W_MXFP4, "manual": K.W_MXFP4_MANUAL, "bits": K.W_MXFP4_BITS}


def pick_config(num_pairs: int, num_experts: int) -> MoEConfig:
    return DECODE_CONFIG if num_pairs <= 4 * num_experts else PREFILL_CONFIG


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
                   w4_decode: str = "dot_scaled") -> torch.Tensor:
    """:func:`fused_moe` with an explicit tile config and MXFP4 decode (benchmarks, tests).

    w4_decode: "dot_scaled" (default, measured), "manual" (arithmetic E2M1 decode + tl.dot) or "bits" (fp32
    bit-pattern decode + even/odd split, experimental). ``manual_w4=True`` is the same as ``w4_decode="manual"``.
    With fp32 x and ``act_quant="bf16"`` the fp32-operand path is taken and "dot_scaled" becomes "manual".
    The manual and bits decodes are exact over the whole E8M0 range; Triton's dot_scaled was seen to give NaN
    (interpreter) for scale bytes >= ~140, far above checkpoint scales (< 127).
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig or None, got {type(config).__name__}")
    if w4_decode not in _W4_DECODES:
        raise ValueError(f"w4_decode must be one of {sorted(_W4_DECODES)}, got {w4_decode!r}")
    if manual_w4:
        w4_decode = "manual"
    tokens, top_k = topk_ids.shape
    num_experts, n, hidden, kout = weights.num_experts, weights.intermediate, weights.hidden, weights.out_features
    out = torch.empty(tokens, kout, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    cfg = config or pick_config(tokens * top_k, num_experts)
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
