"""``fused_moe`` on Triton: align -> [MXFP8 round trip of x] -> w13 GEMM + activation -> w2 GEMM -> top-k reduce.

One GEMM design (swap-AB MMA over the used (expert block, 128-row tile, K split) items, the decoded weights as
the wide operand, the same layout, decode and epilogue math) in two kernels: :func:`.kernels.moe_gemm_kernel`
(persistent Triton, every backend, decode and prefill; only the tiles change: :func:`pick_config`) and, on sm_90,
:func:`.gemm_hopper.moe_gemm_ws_kernel` (warp-specialised Gluon: TMA producer warps, decode + register-A wgmma
consumer, 16- to 128-row blocks, launched as programmatic dependent launches; the same decode bits and
epilogue math, 1.2-1.3x ``moe_gemm_kernel``'s speed on the H200 at decode and 1.2x at prefill, benchmarks/RESULTS.md
sessions 7 to 9). Launches at decode (A16W4): the align (which also zeroes the GEMMs' item counters), the w13
GEMM, the w2 GEMM and the reduce (4; A8W4 adds the x round trip); on sm_90 the align, the reduce and the Hopper kernel's
GEMMs start as programmatic dependent launches and wait for the kernel before on the device. Every expert weight tile is read once per block
of ``block_m`` rows routed to it, so at decode (every used expert has one block) the bytes moved are the active
experts' weights, once. On the Hopper kernel the w2 GEMM may run in K parts where few items would leave CTAs idle
(:func:`.gemm_hopper.w2_parts`; the reduce sums the parts).

Weights: MXFP4 experts must be in the ``triton`` layout (:mod:`.layout`, made once by :func:`prepare_weights`,
which keeps only the re-laid tensors). Experts in another layout are prepared on their first call and the result
cached in ``weights.extras`` (then they sit in memory twice: call :func:`prepare_weights` at load time instead).
bf16 experts are read in checkpoint layout.

A8W4 (``act_quant="mxfp8"``): x and the activation output are rounded through MXFP8 (the reference's rule, exact
in bf16) and the GEMMs run on the bf16 MMA with those values; no FP8 MMA. Both kernels round the activation
output in their w13 epilogue (:func:`.mx.mxfp8_value`), so A8W4 costs what A16W4 costs plus the x round trip.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.triton_kernels.moe import grouped
from rocm_k3.triton_kernels.moe import kernels as K
from rocm_k3.triton_kernels.moe import layout
from rocm_k3.triton_kernels.moe.align import align_routing
from rocm_k3.triton_kernels.moe.decode import DECODE_ASM, DECODE_PORTABLE
from rocm_k3.triton_kernels.runtime import interpreted

LAYOUT = layout.LAYOUT
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# E4M3 variants: (scale exponent offset EMAX, exponent bias, largest finite value)
_FP8 = {torch.float8_e4m3fn: (8, 7, 448.0), torch.float8_e4m3fnuz: (7, 8, 240.0)}
_INTERPRETER_PROGRAMS = 3  # persistent grid under TRITON_INTERPRET (a few programs exercise the item loop)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Tiles of both GEMMs. block_m: rows of one expert block (the MMA's narrow side: tokens at decode), a power
    of two >= 16; block_k: K per pipeline step, 128 or 256 (256 only for a GEMM whose K, padded to 128, is a
    multiple of 256; the other GEMM then steps by 128); num_warps 4 (one warpgroup owns the 128-row tile);
    num_stages: pipeline depth; split_k: K splits of the w2 GEMM (summed in the reduce); programs_per_sm:
    persistent programs per SM (the grid is this times the SM count, capped by the work); max_registers: the
    NVIDIA register cap per thread that lets ``programs_per_sm`` 128-thread programs stay resident at once
    (65536 / (128 * programs_per_sm); None: no cap), applied to the inline-PTX MXFP4 GEMMs only (the fp32-operand
    and portable paths need more registers and are not the fast path); dynamic: programs claim items from an
    atomic counter (zeroed per call) instead of a fixed round-robin share."""

    block_m: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    programs_per_sm: int = 4
    max_registers: int | None = 128
    dynamic: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "num_warps", "num_stages", "split_k", "programs_per_sm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"MoEConfig.block_m must be a power of two >= 16 (the MMA's N side), got {self.block_m}")
        if self.block_k not in (128, 256):
            raise ValueError(f"MoEConfig.block_k must be 128 or 256 (whole scale groups), got {self.block_k}")
        if self.num_warps != 4:
            raise ValueError(f"MoEConfig.num_warps must be 4 (one warpgroup per 128-row tile), got {self.num_warps}")
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"MoEConfig.dynamic must be a bool, got {self.dynamic!r}")
        if self.max_registers is not None and (isinstance(self.max_registers, bool) or
                                               not isinstance(self.max_registers, int) or
                                               not 24 <= self.max_registers <= 255):
            raise ValueError(f"MoEConfig.max_registers must be None or an int in [24, 255], got {self.max_registers!r}")


# The tile table: (most rows an expert gets on average, block_m, programs per SM, register cap of moe_gemm_kernel);
# the Hopper kernel runs the same block_m at gemm_hopper.default_config. K3 (896 experts, top-16) on the H200,
# 2026-12-04 sweep (benchmarks/RESULTS.md, "MoE prefill tiles"): T = 256 / 512 -> 16 rows (4.6-4.8 / 4.7-5.2 ms;
# 32 rows 5.5 ms at 512), T = 1024 -> 32 (5.9 ms; 16 rows 7.7, 64 rows 7.4), T = 2048 -> 64 (8.2 ms; 32 rows 10.1,
# 128 rows 14.3), T = 8192 -> 64 (24.6-27.0 ms; 128 rows 28.8, moe_gemm_kernel at 128 rows 36.1). Session 16: the
# Hopper kernel's 256-row weight tiles (gemm_hopper.wide_config) 5.87 vs 6.15 ms at T = 1024 (bm32, within the
# default's spread across calls), 8.66 vs 8.47 at 2048 and 26.72 vs 26.56 at 8192 (bm64): not picked.
TILE_TABLE = ((12.0, 16, 4, 128), (24.0, 32, 3, 168), (float("inf"), 64, 2, None))


def pick_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """Tiles for a routing of ``num_pairs`` (token, slot) pairs over ``num_experts`` experts.

    block_m from :data:`TILE_TABLE` by the rows an expert gets on average (16 at decode; K3: up to T ~ 700), up
    to 64 at prefill (128-row blocks pad K3's 37 / 146 rows per expert at T = 2048 / 8192 to 128 / 256 rows and
    were 1.17-1.76x slower in the sweep).
    No K split: on the H200 at K3 shapes the unsplit w2 was the fastest in every run (T = 1: 153.8 us against
    157.7 / 161.2 us split 2 / 4 ways; T = 4: 453.0 against 472.0 / 490.0 us; benchmarks/RESULTS.md, session 4).
    Items from the atomic counter (``dynamic``) from 64 pairs up (K3: T >= 4; 437 against 463 us at T = 4, 1401
    against 1442 at T = 16, level at prefill); at T = 1 (1.5 items per program) its zeroing and claims cost more
    (170 against 155 us) than the balance gains.
    """
    per_expert = num_pairs / max(1, num_experts)
    block_m, per_sm, regs = next(row[1:] for row in TILE_TABLE if per_expert <= row[0])
    return MoEConfig(block_m=block_m, programs_per_sm=per_sm, max_registers=regs, dynamic=num_pairs >= 64)


def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
    """Experts -> what this backend's kernels read: MXFP4 in the ``triton`` layout (only the re-laid tensors are
    kept), bf16 experts in checkpoint layout made contiguous, tagged ``layout="triton"``. Idempotent."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    if weights.layout == LAYOUT:
        return weights
    if weights.fmt == "mxfp4":
        return layout.prepare(weights)
    src = weights.to_checkpoint()
    return ExpertWeights("bf16", src.w13.contiguous(), None, src.w2.contiguous(), None, layout=LAYOUT)


def _kernel_weights(weights: ExpertWeights) -> ExpertWeights:
    """Prepared weights as they are; others prepared once and cached in ``weights.extras`` (a second copy)."""
    if weights.layout == LAYOUT:
        return weights
    cached = weights.extras.get(f"{LAYOUT}-prepared")
    if cached is None:
        cached = prepare_weights(weights)
        weights.extras[f"{LAYOUT}-prepared"] = cached  # extras is the backend-private cache of ExpertWeights
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


def _mxfp8_round_trip(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x [R, K] -> bf16 [R, K]: the MXFP8 value of x (ct rule), exact in bf16."""
    emax, bias, fmax = _FP8[fp8_dtype]
    rows, k = x.shape
    out = torch.empty(rows, k, dtype=torch.bfloat16, device=x.device)
    if rows:
        block_k = min(256, triton.next_power_of_2(k))
        K.mxfp8_round_trip_kernel[(triton.cdiv(rows, 4), triton.cdiv(k, block_k))](
            x, out, rows, k, x.stride(0), out.stride(0), EMAX=emax, BIAS=bias, FP8_MAX=fmax, ROWS=4, BLOCK_K=block_k,
        )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def fused_moe(x: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              activation: MoEActivation = MoEActivation(), act_quant: str = "bf16",
              fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * W2_e act(W13_e x_t)`` -> [T, Kout] in x dtype (see module doc)."""
    return fused_moe_with(x, weights, topk_weights, topk_ids, activation=activation, act_quant=act_quant,
                          fp8_dtype=fp8_dtype)


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """One GEMM's weight operand as the kernel takes it."""

    w: torch.Tensor
    ws: torch.Tensor
    strides: tuple[int, int, int, int, int]  # expert, row group, scale expert, scale row group, row (bf16)
    fold: bool
    tiles: int  # 128-row tiles


def _matrices(weights: ExpertWeights) -> tuple[_Matrix, _Matrix]:
    n, kout = weights.intermediate, weights.out_features
    if weights.fmt == "mxfp4":
        t = weights.extras[LAYOUT]
        def mat(w, ws, fold):
            return _Matrix(w, ws, (w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), 0), fold, w.shape[1] // 2)
        return mat(t.w13, t.w13_s, t.fold13), mat(t.w2, t.w2_s, t.fold2)
    w13, w2 = weights.w13, weights.w2
    return (_Matrix(w13, w13, (w13.stride(0), 0, 0, 0, w13.stride(1)), True, triton.cdiv(n, 64)),
            _Matrix(w2, w2, (w2.stride(0), 0, 0, 0, w2.stride(1)), True, triton.cdiv(kout, 128)))


def _ws_applies(stage, mat, weights, a, kdim, cfg, common, required) -> bool:
    """Whether one GEMM runs on the warp-specialised Hopper kernel (see :func:`fused_moe_with`); ``a``: its
    activation operand; ``required``: a ValueError naming why instead of False. ``common``: the constexprs
    ``moe_gemm_kernel`` would get (decode, activation, epilogue math)."""
    ok, why = (False, "needs MXFP4 experts and the inline-PTX decode")
    if weights.fmt == "mxfp4" and common["DECODE"] == DECODE_ASM:
        try:
            from rocm_k3.triton_kernels.moe import gemm_hopper
        except ImportError as exc:  # a Triton without Gluon
            ok, why = False, f"Gluon is not available ({exc})"
        else:
            ok, why = gemm_hopper.supported(a, mat.fold, cfg.block_m, cfg.split_k, kdim)
    if not ok and required:
        raise ValueError(f"gemm='ws' does not apply to the w{'13' if stage == 1 else '2'} GEMM: {why}")
    return ok


def _ws_pair(ws_config) -> tuple | None:
    """``ws_config`` as (w13's WsConfig, w2's WsConfig), or None for the defaults: one WsConfig is taken for both
    GEMMs, a pair per GEMM (e.g. w2 on 256-row weight tiles, w13 on 128). Both must launch alike (``pdl``): the
    align, the two GEMMs and the reduce form one chain of dependent launches."""
    if ws_config is None:
        return None
    from rocm_k3.triton_kernels.moe.gemm_hopper import WsConfig  # Gluon: only where a WsConfig can exist

    pair = (ws_config, ws_config) if isinstance(ws_config, WsConfig) else ws_config
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(w, WsConfig) for w in pair)):
        raise TypeError("ws_config must be a gemm_hopper.WsConfig, a (w13, w2) tuple of two, or None, got "
                        f"{type(ws_config).__name__}")
    if pair[0].pdl != pair[1].pdl:
        raise ValueError(f"ws_config: w13's pdl ({pair[0].pdl}) and w2's ({pair[1].pdl}) must agree (the align, "
                         "both GEMMs and the reduce launch as one chain)")
    return pair


def _ws_tiles(mat: _Matrix, ws) -> int:
    """Items per block (and K part) of the Hopper kernel: ``ws.tile_rows``-row weight tiles (the last one of an
    odd count of 128-row tiles reads past the expert's rows at 256: its outputs are masked, n >= n_out)."""
    return triton.cdiv(mat.tiles * 128, ws.tile_rows)


def _ws_gemm(stage, mat, weights, a, dst, tw, routing, top_k, n_out, activation, common, programs, ws, split,
             out_mx) -> None:
    """One GEMM on the warp-specialised Hopper kernel into ``dst`` (``ws``: its WsConfig, ``split``: w2's K parts,
    ``out_mx``: (EMAX, BIAS, FP8_MAX) to round the w13 output through MXFP8, A8W4)."""
    from rocm_k3.triton_kernels.moe import gemm_hopper

    key = f"triton-ws{stage}-{ws.groups}"  # the prepared weights' TMA descriptors per GEMM and box height, made once
    desc = weights.extras.get(key)
    if desc is None:
        t = weights.extras[LAYOUT]
        desc = gemm_hopper.descriptors(*((t.w13, t.w13_s) if stage == 1 else (t.w2, t.w2_s)), ws.groups)
        weights.extras[key] = desc
    gemm_hopper.launch(stage, desc, a, dst, tw, routing, _ws_tiles(mat, ws), n_out, top_k,
                       float(activation.beta), float(activation.linear_beta or 1.0), common["ACT"],
                       common["HAS_LINEAR_BETA"], common["FAST_ACT"], programs, ws, split, out_mx)


def fused_moe_with(x, weights, topk_weights, topk_ids, *, activation=MoEActivation(), act_quant="bf16",
                   fp8_dtype=None, config: MoEConfig | None = None, decode: str | None = None,
                   act_math: str | None = None, gemm: str | None = None, ws_config=None) -> torch.Tensor:
    """:func:`fused_moe` with explicit tiles (``config``, default :func:`pick_config`), MXFP4 decode (``decode``:
    "asm" or "portable"; default: asm on NVIDIA, portable in the interpreter and on AMD), w13 epilogue math
    (``act_math``: "fast", the MUFU sigmoids of ``.kernels`` FAST_ACT, or "portable"; default: fast on NVIDIA,
    portable elsewhere) and GEMM kernel (``gemm``: "ws", the warp-specialised Hopper kernel of :mod:`.gemm_hopper`
    for both GEMMs (a ValueError where it does not apply), "triton", :func:`.kernels.moe_gemm_kernel`, "grouped",
    dequantised experts and ``torch._grouped_mm`` (:mod:`.grouped`; bf16 x, MXFP4 experts; syncs once with the
    host only when the experts exceed its scratch; decode="asm" does not apply there); default: "grouped" where
    :func:`.grouped.auto_selects` (prefill at many rows per expert, no explicit ``config`` / ``ws_config`` /
    ``decode="asm"``), else "ws" for each GEMM where :func:`.gemm_hopper.supported` and the inline-PTX decode
    apply, else "triton";
    ``ws_config``: the Hopper kernel's :class:`.gemm_hopper.WsConfig` for both GEMMs or a (w13, w2) pair of them,
    default :func:`.gemm_hopper.default_config` of the block size, which must equal ``config``'s). Decode
    and epilogue math are independent: with the default math "asm" and "portable" give the same bits; "ws" and
    "triton" run the same decode and epilogue math (outputs equal up to the fp32 summation order of the MMA)."""
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig or None, got {type(config).__name__}")
    if decode not in (None, "asm", "portable"):
        raise ValueError(f"decode must be 'asm', 'portable' or None, got {decode!r}")
    if act_math not in (None, "fast", "portable"):
        raise ValueError(f"act_math must be 'fast', 'portable' or None, got {act_math!r}")
    if gemm not in (None, "ws", "triton", "grouped"):
        raise ValueError(f"gemm must be 'ws', 'triton', 'grouped' or None, got {gemm!r}")
    ws_pair = _ws_pair(ws_config)
    weights = _kernel_weights(weights)
    tokens, top_k = topk_ids.shape
    num_experts, n, hidden, kout = weights.num_experts, weights.intermediate, weights.hidden, weights.out_features
    out = torch.empty(tokens, kout, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    interp = interpreted(K.moe_gemm_kernel)
    nvidia = x.device.type == "cuda" and torch.version.hip is None
    for name, value, fast in (("decode", decode, "asm"), ("act_math", act_math, "fast")):
        if value == fast and (interp or not nvidia):
            raise ValueError(f"{name}={fast!r} (inline PTX) runs on NVIDIA GPUs only, not in the interpreter or on AMD")
    if gemm == "ws" and (interp or not nvidia):  # before any launch (the others are checked per GEMM)
        raise ValueError("gemm='ws' (the Hopper kernel) runs on NVIDIA sm_90 GPUs only, not in the interpreter or "
                         "on AMD")
    a8 = act_quant == "mxfp8"
    emax, bias, fmax = _FP8.get(fp8_dtype, (8, 7, 448.0))
    if gemm == "grouped" or (gemm is None and config is None and ws_config is None and decode != "asm"
                             and grouped.auto_selects(x, weights, tokens, top_k, act_quant)):
        ok, why = grouped.supports(x, weights, interp)
        if not ok:
            raise ValueError(f"gemm='grouped' does not apply: {why}")
        if decode == "asm":
            raise ValueError("decode='asm' does not apply to gemm='grouped' (its dequant kernel decodes portably)")
        x = x if x.stride(-1) == 1 else x.contiguous()
        return grouped.fused_moe_grouped(
            _mxfp8_round_trip(x, fp8_dtype) if a8 else x, weights, topk_weights, topk_ids, out,
            activation=activation, out_mx=(emax, bias, fmax) if a8 else None,
            fast_act=nvidia and not interp and act_math != "portable")
    w13m, w2m = _matrices(weights)
    num_sms = _num_sms(x.device)
    cfg = config or pick_config(tokens * top_k, num_experts)
    if ws_pair is not None and any(w.block_m != cfg.block_m for w in ws_pair):
        raise ValueError(f"ws_config.block_m ({'/'.join(str(w.block_m) for w in ws_pair)}) must equal the "
                         f"MoEConfig's block_m ({cfg.block_m}): both GEMMs read one routing")
    op_f32 = x.dtype == torch.float32 and not a8  # fp32 operands, IEEE dots (module doc of .kernels)
    dec = DECODE_PORTABLE if (op_f32 or interp or not nvidia or decode == "portable") else DECODE_ASM
    # programmatic dependent launches (sm_90+): the align and the reduce start early and wait on the device
    pdl = (nvidia and not interp and torch.cuda.get_device_capability(x.device) >= (9, 0)
           and (ws_pair is None or ws_pair[0].pdl))
    routing = align_routing(topk_ids, num_experts, cfg.block_m, pdl=pdl)
    num_blocks = routing.block_expert.numel()
    padded_rows = routing.sorted_pairs.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    xa = _mxfp8_round_trip(x, fp8_dtype) if a8 else x
    inter = torch.empty(padded_rows, n, dtype=torch.float32 if op_f32 else torch.bfloat16, device=x.device)
    tw = topk_weights.reshape(-1).to(torch.float32)
    linear_beta = activation.linear_beta
    common = dict(W_FMT=K.W_MXFP4 if weights.fmt == "mxfp4" else K.W_BF16, DECODE=dec, OP_F32=op_f32,
                  DOT_F32=interp, ACT=K.ACT_SITU if activation.kind == "situ" else K.ACT_SILU,
                  HAS_LINEAR_BETA=linear_beta is not None, EMAX=emax, BIAS=bias, FP8_MAX=fmax,
                  BMT=cfg.block_m, STAGES=cfg.num_stages, DYNAMIC=cfg.dynamic,
                  FAST_ACT=nvidia and not interp and act_math != "portable", num_warps=cfg.num_warps)
    programs = _INTERPRETER_PROGRAMS if interp else cfg.programs_per_sm * num_sms
    if dec == DECODE_ASM and weights.fmt == "mxfp4" and cfg.max_registers is not None:  # the tiles it is sized for
        common["maxnreg"] = cfg.max_registers
    on_ws = {1: False, 2: False}  # GEMMs on the warp-specialised Hopper kernel
    if gemm != "triton":
        on_ws = {1: _ws_applies(1, w13m, weights, xa, hidden, cfg, common, gemm == "ws"),
                 2: _ws_applies(2, w2m, weights, inter, n, cfg, common, gemm == "ws")}
    split, ws_of = cfg.split_k, {}  # ws_of: stage -> the WsConfig of a GEMM on the Hopper kernel
    if on_ws[1] or on_ws[2]:
        from rocm_k3.triton_kernels.moe import gemm_hopper

        pair = ws_pair or (gemm_hopper.default_config(cfg.block_m),) * 2
        ws_of = {stage: pair[stage - 1] for stage in (1, 2) if on_ws[stage]}
        if on_ws[2]:  # expected blocks at decode: one per used expert (distinct experts of uniform routing)
            ws2 = ws_of[2]
            expected = num_experts * (1 - (1 - top_k / num_experts) ** tokens) if cfg.block_m == 16 else num_blocks
            split = gemm_hopper.w2_parts(ws2, expected * _ws_tiles(w2m, ws2), ws2.ctas_per_sm * num_sms,
                                         triton.cdiv(n, 128))
    y = torch.empty(split, tokens * top_k, kout, dtype=torch.float32, device=x.device)  # weighted per-pair outputs
    # item counters of the dynamic schedule (zeroed by the align): w13 word 0, w2 word 4 (16-byte aligned pointers)
    for stage, mat, kdim, n_out, nsplit, work in ((1, w13m, hidden, n, 1, routing.work),
                                                  (2, w2m, n, kout, split, routing.work[4:])):
        a, dst = (xa, inter) if stage == 1 else (inter, y)
        if on_ws[stage]:
            ws = ws_of[stage]
            _ws_gemm(stage, mat, weights, a, dst, tw, routing, top_k, n_out, activation, common,
                     max(1, min(ws.ctas_per_sm * num_sms, num_blocks * _ws_tiles(mat, ws) * nsplit)), ws, nsplit,
                     (emax, bias, fmax) if a8 and stage == 1 else None)
            continue
        bk = cfg.block_k if triton.cdiv(kdim, 128) * 128 % cfg.block_k == 0 else 128
        steps = triton.cdiv(triton.cdiv(kdim, bk), nsplit)
        grid = (max(1, min(programs, num_blocks * mat.tiles * nsplit)),)
        K.moe_gemm_kernel[grid](
            a, mat.w, mat.ws, dst, tw, routing.sorted_pairs, routing.block_expert, routing.expert_start,
            routing.expert_count, routing.num_blocks, work, kdim, n_out, top_k, mat.tiles, steps,
            a.stride(0), *mat.strides, dst.stride(-2), dst.stride(0) if stage == 2 else 0,
            float(activation.beta), float(linear_beta or 1.0),
            STAGE=stage, FOLD=mat.fold, OUT_MX=a8 and stage == 1, EVEN_K=kdim % bk == 0, SPLIT=nsplit, KU=bk // 64,
            **common,
        )
    block = min(256 if tokens < 64 else 1024, triton.next_power_of_2(kout))  # decode: more programs
    K.topk_reduce_kernel[(tokens, triton.cdiv(kout, block))](
        y, out, kout, y.stride(1), y.stride(0), out.stride(0), TOP_K=top_k, SPLIT=split, BLOCK=block, PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
