"""Host side of the FlyDSL ``fused_moe``: expert alignment, weight preparation and the stage pipeline.

Pipeline (every GEMM is a FlyDSL kernel; the alignment is a few torch ops on the device plus one
host sync for the block count):

    align_pairs(topk_ids)             -> sorted pair ids in 16-row expert blocks, block -> expert
    [A8W4] mxfp8_quant(x)             -> x codes + E8M0 scales (FNUZ on gfx942, OCP on gfx950)
    moe_gemm stage 1 (w13, SiTU)      -> H [P, N] (bf16 for A16W4, fp32 for A8W4)
    [A8W4] mxfp8_quant(H)             -> H codes + scales
    moe_gemm stage 2 (w2, topk weight)-> Y fp32 [S * T*top_k, Kout] (S K-splits when the blocks are few)
    moe_reduce                        -> out [T, Kout] in x's dtype (sum over the splits and the top_k)

Compile-verified only (gfx942, gfx950); not yet run on an AMD GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rocm_k3.flydsl_kernels.ops_impl import lazy_builder, stream_of
from rocm_k3.flydsl_kernels.plans import MOE_BLOCK_M, MOE_K_GROUP
from rocm_k3.flydsl_kernels.weights import (
    layout_for_arch,
    preshuffle_codes,
    to_checkpoint,
)
from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.ops.moe_types import DEFAULT_ACTIVATION

LAYOUT = "flydsl"
_FP8_FOR_ARCH = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


class MoeBlocks(NamedTuple):
    """Expert-sorted (token, slot) pairs in blocks of 16 rows.

    sorted_pairs: int32 [B*16] pair index t*top_k + j, ``num_pairs`` on padding rows;
    block_expert: int32 [B]; num_pairs = T*top_k; num_blocks = B.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    num_blocks: int


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int = MOE_BLOCK_M) -> MoeBlocks:
    """Group the pairs of ``topk_ids`` int [T, k] by expert (stable) and pad each expert to ``block_m`` rows."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k]
    num_pairs = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)  # [T*k] pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_start = torch.cumsum(padded, 0) - padded  # [E] first padded row of each expert
    sort_start = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    num_blocks = int(padded.sum().item()) // block_m  # the one host sync
    experts = flat[order]  # [T*k]
    dest = pad_start[experts] + torch.arange(num_pairs, device=dev) - sort_start[experts]  # [T*k]
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=dev), padded // block_m)
    return MoeBlocks(sorted_pairs, block_expert.to(torch.int32), num_pairs, num_blocks)


def prepare_weights(weights: ExpertWeights, arch: str) -> ExpertWeights:
    """MXFP4 experts (any layout) -> ``ExpertWeights.prepared`` in ``layout="flydsl"``: only the pre-shuffled
    tensors of ``arch`` are kept, in ``extras`` (the experts sit in memory once; the reference and other backends
    read them through ``ExpertWeights.checkpoint_expert``, i.e. :func:`weights.checkpoint_expert`).

    extras: ``arch``, ``k_layout`` ("step" for gfx942, "lane" for gfx950), ``w13_q`` int32
    [E, 2N/16, K/128, 64, 4], ``w13_s`` uint8 [E, 2N/16, K/128, 16, 4], ``w2_q``, ``w2_s`` likewise for w2.
    """
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be ExpertWeights, got {type(weights).__name__}")
    if weights.fmt != "mxfp4":
        raise ValueError(f"the FlyDSL MoE kernels take MXFP4 experts, got fmt={weights.fmt!r}")
    k_layout = layout_for_arch(arch)
    for name, size in (("hidden", weights.hidden), ("intermediate", weights.intermediate)):
        if size % MOE_K_GROUP:
            raise ValueError(f"{name} size {size} must be a multiple of {MOE_K_GROUP} for the FlyDSL MoE kernels")
    src = weights.to_checkpoint()
    w13_q, w13_s = preshuffle_codes(src.w13, src.w13_scale, k_layout)
    w2_q, w2_s = preshuffle_codes(src.w2, src.w2_scale, k_layout)
    extras = {"arch": arch, "k_layout": k_layout, "w13_q": w13_q, "w13_s": w13_s, "w2_q": w2_q, "w2_s": w2_s}
    return ExpertWeights.prepared("mxfp4", LAYOUT, src.dims, extras)


def restore_weights(prepared: ExpertWeights) -> ExpertWeights:
    """Exact inverse of :func:`prepare_weights`, rebuilt from ``extras`` alone (checkpoint layout)."""
    if prepared.layout != LAYOUT:
        raise ValueError(f"weights have layout {prepared.layout!r}, not {LAYOUT!r}")
    return to_checkpoint(prepared)


def _activation_tuple(activation: MoEActivation) -> tuple:
    if activation.kind == "silu":
        return ("silu", 0.0, None)
    return ("situ", float(activation.beta), None if activation.linear_beta is None else float(activation.linear_beta))


def fused_moe_supports(x, weights, topk_weights, topk_ids, *, activation=DEFAULT_ACTIVATION, act_quant="bf16",
                       fp8_dtype=None) -> tuple[bool, str]:
    """Whether the FlyDSL pipeline takes this call (the public op has already validated shapes)."""
    if weights.layout != LAYOUT or "arch" not in weights.extras:
        return False, "weights are not prepared for flydsl: call rocm_k3.flydsl_kernels.backend.prepare_weights first"
    arch = weights.extras["arch"]
    if x.device.type == "cuda":
        from rocm_k3.ops.devices import device_info

        if device_info(x.device).arch != arch:
            return False, f"weights were prepared for {arch}, the call runs on {device_info(x.device).arch}"
    if weights.out_features % MOE_K_GROUP or weights.intermediate % MOE_K_GROUP or weights.hidden % MOE_K_GROUP:
        return False, f"hidden, intermediate and out sizes must be multiples of {MOE_K_GROUP}"
    if act_quant == "bf16" and x.dtype not in (torch.bfloat16, torch.float16):
        return False, f"A16W4 takes bf16/fp16 activations, got {x.dtype}"
    if act_quant == "mxfp8" and fp8_dtype != _FP8_FOR_ARCH[arch]:
        return False, f"A8W4 on {arch} computes in {_FP8_FOR_ARCH[arch]}, the call asks for {fp8_dtype}"
    if not x.is_contiguous():
        return False, "x must be contiguous"
    return True, f"flydsl MXFP4 MoE ({'A8W4' if act_quant == 'mxfp8' else 'A16W4'}, {arch})"


_gemm = lazy_builder("rocm_k3.flydsl_kernels.moe_gemm", "build_moe_gemm")


_quant = lazy_builder("rocm_k3.flydsl_kernels.moe_aux", "build_mxfp8_quant")


_reduce = lazy_builder("rocm_k3.flydsl_kernels.moe_aux", "build_moe_reduce")


def _mx_quant(t: torch.Tensor, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from rocm_k3.flydsl_kernels.common import dtype_name
    from rocm_k3.flydsl_kernels.moe_aux import Mxfp8QuantConfig

    rows, k = t.shape
    codes = torch.empty(rows, k, dtype=torch.uint8, device=t.device)
    scales = torch.empty(rows, k // 32, dtype=torch.uint8, device=t.device)
    if rows:
        _quant(Mxfp8QuantConfig(k, dtype_name(t.dtype), fnuz))(t, codes, scales, rows, **stream_of(t))
    return codes, scales


def fused_moe(x, weights, topk_weights, topk_ids, *, activation=DEFAULT_ACTIVATION, act_quant="bf16", fp8_dtype=None):
    """FlyDSL implementation of ``rocm_k3.ops.moe.fused_moe`` (same signature minus ``backend``)."""
    from rocm_k3.flydsl_kernels.common import dtype_name
    from rocm_k3.flydsl_kernels.moe_aux import MoeReduceConfig
    from rocm_k3.flydsl_kernels.moe_gemm import MoeGemmConfig

    ex = weights.extras
    arch = ex["arch"]
    T, K = x.shape
    top_k = topk_ids.shape[1]
    N, Kout = weights.intermediate, weights.out_features
    out = torch.empty(T, Kout, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    fp8 = act_quant == "mxfp8"
    fnuz = arch == "gfx942"
    act = _activation_tuple(activation)
    blocks = align_pairs(topk_ids, weights.num_experts)
    P = blocks.num_blocks * MOE_BLOCK_M
    topw = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    fmt = "fp8" if fp8 else "bf16"
    h_dtype = torch.float32 if fp8 else torch.bfloat16

    if fp8:
        a1, a1_scale = _mx_quant(x, fnuz)
    else:
        a1, a1_scale = x, x
    h = torch.empty(P, N, dtype=h_dtype, device=x.device)
    cfg1 = MoeGemmConfig(arch, 1, fmt, K, N, top_k, a_dtype=dtype_name(x.dtype) if not fp8 else "bf16",
                         out_dtype=dtype_name(h_dtype), activation=act)
    _gemm(cfg1)(a1, a1_scale, blocks.sorted_pairs, blocks.block_expert, ex["w13_q"], ex["w13_s"], h, topw,
                blocks.num_pairs, blocks.num_blocks, **stream_of(x))

    a2, a2_scale = _mx_quant(h, fnuz) if fp8 else (h, h)
    split = w2_split_k(blocks.num_blocks, Kout, N, torch.cuda.get_device_properties(x.device).multi_processor_count
                       if x.is_cuda else 1)
    y = torch.empty(split * blocks.num_pairs, Kout, dtype=torch.float32, device=x.device)
    cfg2 = MoeGemmConfig(arch, 2, fmt, N, Kout, top_k, a_dtype="bf16", activation=act, split_k=split)
    _gemm(cfg2)(a2, a2_scale, blocks.sorted_pairs, blocks.block_expert, ex["w2_q"], ex["w2_s"], y, topw,
                blocks.num_pairs, blocks.num_blocks, **stream_of(x))
    _reduce(MoeReduceConfig(Kout, top_k, dtype_name(x.dtype), split))(y, out, T, **stream_of(x))
    return out


def w2_split_k(num_blocks: int, kout: int, n: int, num_cus: int) -> int:
    """K splits of the w2 GEMM: doubled (up to 4, dividing N/128) while its workgroups number fewer than 4 per CU
    (K3 decode on a 304-CU MI300X: T = 1 has 16 blocks x 28 column tiles = 448 workgroups -> 4 splits)."""
    per_split = kout // 128 * num_blocks  # workgroups of one split (128 output columns each)
    split = 1
    while split < 4 and per_split * split < 4 * num_cus and (n // MOE_K_GROUP) % (2 * split) == 0:
        split *= 2
    return split
