"""`compile` tier: every FlyDSL kernel builds for gfx942 and gfx950 at K3 and TP-8 shapes; ISA checks.

Runs on a CPU machine (FlyDSL COMPILE_ONLY mode, Debian's lld-19 as the linker). For each kernel and target
the final ISA must show: no scratch (no private segment, no spills, no scratch_* instruction), a VGPR count
(arch VGPRs + AGPRs as allocated) within the budget stated here, the expected matrix instructions (bf16 or
FNUZ-fp8 MFMA on gfx942, bf16 MFMA or v_mfma_scale_*_f8f6f4 on gfx950), the vector width of the kernel's
plan in its loads (e.g. buffer_load_dwordx4 for 128-bit row accesses), no waterfall loop (a buffer
descriptor that differs across lanes), and no LLVM error on stderr. The MoE GEMMs also meet a budget of VALU
instructions per weight in their K loop (``_MOE_VALU_BUDGET``) and use their decode's instructions
(``v_perm_b32`` on gfx942, ``v_cvt_scalef32_pk_bf16_fp4`` on gfx950).
Each (kernel, target) compiles exactly once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("flydsl", reason="flydsl is not installed (pip install flydsl==0.5.0)")

from rocm_k3.flydsl_kernels.isa import KernelIsa, loops
from rocm_k3.flydsl_kernels.plans import MOE_K_GROUP
from rocm_k3.flydsl_kernels.toolchain import compile_launcher, find_lld

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(find_lld() is None, reason="no ld.lld for FlyDSL compile-only links (apt-get install lld-19)"),
]

BF16, F32, U8, I32 = torch.bfloat16, torch.float32, torch.uint8, torch.int32
ARCHES = ("gfx942", "gfx950")
# K3 (config.json) and its tensor-parallel-8 shard: MoE intermediate 3072 -> 384 per rank, KDA heads 96 -> 12.
HIDDEN, LATENT, Q_LORA, KV_LORA, HEAD = 7168, 3584, 1536, 512, 128
SHAPES = {"K3": {"heads": 96, "inter": 3072}, "TP8": {"heads": 12, "inter": 384}}
TOP_K, EXPERTS = 16, 8  # expert count only sizes the (runtime-shaped) weight tensors


def z(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel configuration: how to build its launcher, example arguments, and what its ISA must show."""

    id: str
    build: Callable[[str], Any]  # arch -> launcher
    args: Callable[[], tuple]
    vgpr_budget: int
    mfma: Callable[[str], str | None] = lambda arch: None  # expected mnemonic prefix per arch (None: no MFMA)
    load: str | None = None  # the vector load its plan intends (e.g. 128-bit row accesses: buffer_load_dwordx4)
    also: Callable[[str], tuple[str, ...]] = lambda arch: ()  # further instructions the target must use
    kernels: int = 1  # kernels one launcher compiles (each is checked)
    lds_budget: int | None = None  # bytes of LDS (group segment) a kernel may use; None: not checked
    # K-loop budget: arch -> (weights per lane and loop iteration, weights per lane in the whole kernel, max VALU
    # per weight in the loop, max in the whole kernel, mnemonic prefixes the loop must not contain), or None: the
    # innermost loop with an MFMA is checked (the whole kernel when the compiler unrolled a short K loop)
    k_loop: Callable[[str], tuple[int, int, float, float, tuple[str, ...]] | None] = lambda arch: None


def _norm_case(name: str, D: int, **kw: Any) -> Case:
    from rocm_k3.flydsl_kernels.norm import NormConfig, build_norm

    cfg = NormConfig(D, **kw)
    rows = 37
    wdt = F32 if cfg.weight_dtype == "f32" else BF16
    return Case(f"{name}-D{D}", lambda arch: build_norm(cfg),
                lambda: (z(rows, D), z(rows, D), z(D, dtype=wdt), z(rows, D), rows, 1e-5), vgpr_budget=96,
                load="buffer_load_dwordx4")


def _attn_res_case(nb: int, write: bool, has_partial: bool = True) -> Case:
    from rocm_k3.flydsl_kernels.attn_res import AttnResConfig, build_attn_res_step

    cfg = AttnResConfig(HIDDEN, nb, write, has_partial=has_partial)
    T = 5
    return Case(
        f"attn_res_step-B{nb}-{'write' if write else 'nowrite'}-{'pd' if has_partial else 'd'}",
        lambda arch: build_attn_res_step(cfg),
        lambda: (z(T, HIDDEN), z(T, HIDDEN), z(9, T, HIDDEN), z(HIDDEN), z(HIDDEN), z(HIDDEN), z(T, HIDDEN),
                 z(T, HIDDEN), T, 1e-5),
        vgpr_budget=192, load="buffer_load_dwordx2",
    )


def _kda_decode_case(shape: str, D: int = HEAD) -> Case:
    from rocm_k3.flydsl_kernels.kda_decode import KdaDecodeConfig, build_kda_decode

    H = SHAPES[shape]["heads"]
    cfg = KdaDecodeConfig(H, D, 4, "bf16", -5.0)
    N, S, C = 4, 6, 3 * H * D
    return Case(
        f"kda_decode-{shape}-H{H}-D{D}",
        lambda arch: build_kda_decode(cfg),
        lambda: (z(N, C), z(N, H * D), z(N, H), z(N, H * D), z(C, 4), z(S, C, 3), z(H, dtype=F32),
                 z(H * D, dtype=F32), z(D), z(S, H, D, D, dtype=F32), z(N, dtype=I32),
                 z(N, H * D), N, D**-0.5, 1e-5),
        vgpr_budget=192, load="buffer_load_dword",
    )


def _kda_prefill_case(shape: str) -> Case:
    from rocm_k3.flydsl_kernels.kda_prefill import KdaPrefillConfig, build_kda_prefill

    H = SHAPES[shape]["heads"]
    cfg = KdaPrefillConfig(H, HEAD, "bf16", "safe", -5.0)
    T, N, S, M, G = 40, 2, 4, 2, 4

    def args() -> tuple:
        qkv = [z(T, H, HEAD) for _ in range(4)]
        return (*qkv, z(T, H), z(N + 1, dtype=I32), z(S, H, HEAD, HEAD, dtype=F32), z(N, dtype=I32), z(N, dtype=I32),
                z(N + 1, dtype=I32), z(G, dtype=I32), z(G, dtype=I32), z(G, dtype=I32),
                z(M, H, HEAD, HEAD, dtype=F32), z(T, H, HEAD), z(H, dtype=F32), z(H * HEAD, dtype=F32), N, T,
                HEAD**-0.5)

    return Case(f"kda_prefill_recurrent-{shape}-H{H}", lambda arch: build_kda_prefill(cfg), args, vgpr_budget=224,
                load="buffer_load_dword")


def _kda_chunk_case(phase: str, shape: str, dtype: str = "bf16") -> Case:
    """One kernel of the chunked kda_prefill: prep on VALU, the intra kernel's pair sums and the state walk on MFMA
    with the operand type of ``kda_prefill_plan.walk_operands`` (bf16 activations: v_mfma_f32_16x16x16_bf16 and bf16
    intermediates on both targets; fp16: v_mfma_f32_16x16x4_f32 and fp32 intermediates)."""
    from rocm_k3.flydsl_kernels.kda_chunk_intra import build_kda_chunk_intra
    from rocm_k3.flydsl_kernels.kda_chunk_prep import build_kda_chunk_prep
    from rocm_k3.flydsl_kernels.kda_chunk_state import build_kda_chunk_state
    from rocm_k3.flydsl_kernels.kda_prefill import KdaPrefillConfig
    from rocm_k3.flydsl_kernels.kda_prefill_plan import walk_operands

    H = SHAPES[shape]["heads"]
    cfg = KdaPrefillConfig(H, HEAD, dtype, "safe", -5.0)
    act = {"bf16": BF16, "f16": torch.float16}[dtype]
    bf16_walk = walk_operands(dtype) == "bf16"
    T, N, S, M, NC = 200, 2, 4, 2, 5
    f32 = lambda *shape: z(*shape, dtype=F32)
    mid = lambda *shape: z(*shape, dtype=BF16 if bf16_walk else F32)  # the walk's intermediates
    i32 = lambda n: z(n, dtype=I32)
    plan = (i32(NC), i32(NC), i32(N + 1))  # ChunkSeq, ChunkStart, CuSeq
    builds = {"prep": build_kda_chunk_prep, "intra": build_kda_chunk_intra, "state": build_kda_chunk_state}
    args = {
        "prep": lambda: (f32(T, H, HEAD), z(T, H, dtype=act), *plan, f32(H), f32(H * HEAD), f32(T, H, HEAD),
                         f32(T, H), NC),
        "intra": lambda: (z(T, H, HEAD, dtype=act), z(T, H, HEAD, dtype=act), f32(T, H, HEAD), f32(T, H), *plan,
                          mid(T, H, 64), mid(T, H, 64), mid(T, H, HEAD), mid(T, H, HEAD), mid(T, H, HEAD), NC,
                          HEAD**-0.5),
        "state": lambda: (mid(T, H, HEAD), mid(T, H, HEAD), f32(T, H, HEAD), mid(T, H, 64), mid(T, H, HEAD),
                          z(T, H, HEAD, dtype=act), f32(T, H), mid(T, H, 64), i32(N + 1), i32(N + 1),
                          f32(S, H, HEAD, HEAD), i32(N), i32(N), z(T, H, HEAD, dtype=act), f32(M, H, HEAD, HEAD),
                          i32(NC), N),
    }[phase]
    # budgets (arch VGPRs + AGPRs), measured 2026-12-05 (session 22's split) and 2026-12-07 (session 31's MFMA pair sums
    # and bf16 walk): prep 15 (gate and sums only); intra 2 x 4 tiles x 4 accumulators, the step's operands and exps and
    # the 16 solved rows of a diagonal-block column (bf16 152, fp32 133, on both targets); state on fp32 MFMA: 32 state
    # + 16 V' + 4 output accumulator registers plus the hoisted A-operand loads of a 48-MFMA row tile (197 on both: no
    # exps in the MFMA loops since QG / KD come from the intra kernel); on bf16 MFMA 214 on both (the state's bf16 copy
    # and the hoisted 8-byte operand loads of a row tile; two waves per SIMD either way, as under 256)
    budget = {"prep": 32, "intra": 192, "state": 224}[phase]
    if phase == "prep":
        mfma = lambda arch: None
    elif bf16_walk:
        mfma = lambda arch: "v_mfma_f32_16x16x16_bf16"
    else:
        mfma = lambda arch: "v_mfma_f32_16x16x4_f32"
    # the bf16 walk's KB, QG, Ab, Aqk operands: 4 bf16 of a row per lane and step, one 8-byte load
    load = "global_load_dwordx2" if phase == "state" and bf16_walk else None
    return Case(f"kda_chunk_{phase}-{shape}-H{H}-{dtype}", lambda arch: builds[phase](cfg), args,
                vgpr_budget=budget, mfma=mfma, load=load)


_MOE_MFMA = {
    ("bf16", "gfx942"): "v_mfma_f32_16x16x16_bf16",
    ("bf16", "gfx950"): "v_mfma_f32_16x16x32_bf16",
    ("fp8", "gfx942"): "v_mfma_f32_16x16x32_fp8_fp8",  # gfx942 FP8 MFMA = FNUZ e4m3
    ("fp8", "gfx950"): "v_mfma_scale_f32_16x16x128_f8f6f4",
}


# K-loop VALU per weight (arch VGPR ops other than the MFMA, per weight a lane decodes), measured 2026-12-01 with
# flydsl 0.5.0 at the K3 shapes (stage 1 / stage 2): gfx942 bf16 2.63 / 2.81 (byte-lookup decode 1.75, the
# per-block accumulator scaling, register moves), gfx942 fp8 3.15 / 3.78 (before: 12.7), gfx950 bf16 1.19 / 1.34,
# gfx950 fp8 0.54 / 0.65. The select-based gfx942 decode it replaced cost ~15-18 per weight.
_MOE_VALU_BUDGET = {("bf16", "gfx942"): 3.0, ("fp8", "gfx942"): 4.0, ("bf16", "gfx950"): 1.5, ("fp8", "gfx950"): 0.8}
# a short K (TP-8 w2: 3 groups) is unrolled completely by the compiler: then the whole kernel, address setup and
# epilogue included, per weight (measured: gfx950 bf16 1.79, fp8 1.30)
_MOE_VALU_BUDGET_UNROLLED = {("bf16", "gfx942"): 4.0, ("fp8", "gfx942"): 5.0, ("bf16", "gfx950"): 2.0,
                             ("fp8", "gfx950"): 1.5}


def _moe_case(shape: str, stage: int, fmt: str, split_k: int = 1) -> Case:
    from rocm_k3.flydsl_kernels.moe_gemm import MoeGemmConfig, build_moe_gemm

    inter = SHAPES[shape]["inter"]
    K, N = (LATENT, inter) if stage == 1 else (inter, LATENT)
    R = 2 * N if stage == 1 else N  # weight rows
    T, blocks = 3, 3
    P, pairs = 16 * blocks, T * TOP_K
    out_dtype = "bf16" if fmt == "bf16" else "f32"

    def cfg(arch: str) -> MoeGemmConfig:
        return MoeGemmConfig(arch, stage, fmt, K, N, TOP_K, out_dtype=out_dtype, split_k=split_k)

    def args() -> tuple:
        a_rows = T if stage == 1 else P
        a = z(a_rows, K) if fmt == "bf16" else z(a_rows, K, dtype=U8)
        out = z(P, N, dtype=BF16 if out_dtype == "bf16" else F32) if stage == 1 else z(split_k * pairs, N, dtype=F32)
        return (a, z(a_rows, K // 32, dtype=U8), z(P, dtype=I32), z(blocks, dtype=I32),
                z(EXPERTS, R // 16, K // 128, 64, 4, dtype=I32), z(EXPERTS, R // 16, K // 128, 16, 4, dtype=U8),
                out, z(pairs, dtype=F32), pairs, blocks)

    def k_loop(arch: str) -> tuple[int, int, float, float, tuple[str, ...]]:
        c = cfg(arch)
        per_group = c.tiles * (2 if stage == 1 else 1) * 16 * MOE_K_GROUP // 64  # weights per lane and K group
        banned = ("v_cmp", "v_cndmask") if (fmt, arch) == ("bf16", "gfx942") else ()  # no select-based decode
        return (c.ring * per_group, K // MOE_K_GROUP // split_k * per_group, _MOE_VALU_BUDGET[(fmt, arch)],
                _MOE_VALU_BUDGET_UNROLLED[(fmt, arch)], banned)

    def also(arch: str) -> tuple[str, ...]:
        if arch == "gfx950":  # gfx950 decodes FP4 x E8M0 to bf16 in hardware for A16W4
            return ("v_cvt_scalef32_pk_bf16_fp4",) if fmt == "bf16" else ()
        return ("v_perm_b32", "v_pk_fma_f32") if fmt == "bf16" else ("v_perm_b32",)  # byte-lookup decode

    return Case(
        f"moe_stage{stage}-{'A8W4' if fmt == 'fp8' else 'A16W4'}-{shape}-K{K}-N{N}" + (f"-split{split_k}" if split_k > 1
                                                                                        else ""),
        lambda arch: build_moe_gemm(cfg(arch)), args,
        # 2-deep prefetch of weights, scales and activations: up to 256 VGPRs = 2 waves per SIMD (8 per CU)
        vgpr_budget=256, mfma=lambda arch: _MOE_MFMA[(fmt, arch)], load="global_load_dwordx4", also=also,
        k_loop=k_loop,
    )


def _quant_case(K: int, dtype: str) -> Case:
    from rocm_k3.flydsl_kernels.moe_aux import Mxfp8QuantConfig, build_mxfp8_quant

    rows = 7
    return Case(
        f"mxfp8_quant-{dtype}-K{K}",
        lambda arch: build_mxfp8_quant(Mxfp8QuantConfig(K, dtype, fnuz=arch == "gfx942")),
        lambda: (z(rows, K, dtype=F32 if dtype == "f32" else BF16), z(rows, K, dtype=U8), z(rows, K // 32, dtype=U8),
                 rows),
        vgpr_budget=64, load="global_load_dwordx4", also=lambda arch: ("v_cvt_pk_fp8_f32",),
    )


def _gated_act_case(N: int, kind: str) -> Case:
    from rocm_k3.flydsl_kernels.gated_act import GatedActConfig, build_gated_act

    act = ("situ", 4.0, 25.0) if kind == "situ" else ("silu", 0.0, None)
    rows = 9
    return Case(f"{kind}_and_mul-N{N}", lambda arch: build_gated_act(GatedActConfig(N, "bf16", act)),
                lambda: (z(rows, 2 * N), z(rows, N), rows * N // 8), vgpr_budget=64, load="buffer_load_dwordx4")


def _short_conv_case(shape: str) -> Case:
    from rocm_k3.flydsl_kernels.short_conv import ShortConvConfig, build_short_conv

    C = 3 * SHAPES[shape]["heads"] * HEAD
    T, N, S = 10, 2, 4
    return Case(
        f"short_conv-{shape}-C{C}", lambda arch: build_short_conv(ShortConvConfig(C)),
        lambda: (z(T, C), z(C, 4), z(N + 1, dtype=I32), z(T, dtype=I32), z(S, C, 3), z(N, dtype=I32),
                 z(N, dtype=I32), z(T, C), T, N),
        vgpr_budget=64, kernels=2,
    )


def _route_case(E: int, k: int, bias: bool) -> Case:
    from rocm_k3.flydsl_kernels.route import RouteConfig, build_route

    T = 3
    return Case(f"route-E{E}-top{k}{'-bias' if bias else ''}", lambda arch: build_route(RouteConfig(E, k, bias)),
                lambda: (z(T, E, dtype=F32), z(E, dtype=F32), z(T, k, dtype=F32), z(T, k, dtype=I32), T),
                vgpr_budget=64)


def _reduce_case() -> Case:
    from rocm_k3.flydsl_kernels.moe_aux import MoeReduceConfig, build_moe_reduce

    T = 3
    return Case(f"moe_reduce-top{TOP_K}-N{LATENT}", lambda arch: build_moe_reduce(MoeReduceConfig(LATENT, TOP_K)),
                lambda: (z(T * TOP_K, LATENT, dtype=F32), z(T, LATENT), T), vgpr_budget=96,
                load="buffer_load_dwordx4")


def _mla_prefill_case(first: bool, last: bool, gate: str | None) -> Case:
    """The expanded-heads MLA prefill (TP-8 heads, the released 512 + 64 latent, Dn = Dv = 128) in its segment
    variants. Budgets: measured 2026-12-04 (flydsl 0.5.0) gfx942 125-179 VGPRs, gfx950 214-220 (the 48-value Q
    fragments, 32 fp32 O^T accumulators, the block's scores and the hoisted K/V operand loads); <= 256 keeps two
    waves per SIMD. No LDS: the score C fragments are the PV B fragments."""
    from rocm_k3.flydsl_kernels.mla_prefill import MlaPrefillConfig, build_mla_prefill_expanded

    H = SHAPES["TP8"]["heads"]
    T, S = 40, 50
    f32 = lambda *shape: z(*shape, dtype=F32)  # noqa: E731
    gdt = {None: BF16, "bf16": BF16, "f32": F32}[gate]
    return Case(
        f"mla_prefill_expanded-TP8-H{H}-{'first' if first else 'cont'}-{'last' if last else 'mid'}-gate{gate}",
        lambda arch: build_mla_prefill_expanded(MlaPrefillConfig(arch, H, gate_dtype=gate, first=first, last=last)),
        lambda: (z(T, H, 128 + 64), z(S, H, 256), z(S, KV_LORA + 64), z(T, H, 128, dtype=gdt), z(T, H, 128),
                 f32(T, H, 128), f32(T, H, 2), 0, T, 10, 0, S, 0.07),
        vgpr_budget=256, lds_budget=0,
        mfma=lambda arch: {"gfx942": "v_mfma_f32_16x16x16_bf16", "gfx950": "v_mfma_f32_16x16x32_bf16"}[arch],
    )


def _cases() -> list[Case]:
    cases = [
        _norm_case("rms_norm", HIDDEN),
        _norm_case("rms_norm", Q_LORA),
        _norm_case("rms_norm", KV_LORA),
        _norm_case("add_rms_norm", HIDDEN, residual=True),
        _norm_case("gated_rms_norm", HEAD, gated=True),
        _attn_res_case(8, False),
        _attn_res_case(3, True),
        _attn_res_case(0, False, has_partial=False),
        _kda_decode_case("K3"),
        _kda_decode_case("TP8"),
        _kda_decode_case("TP8", D=32),  # the embedded tiny model's head dim
        _short_conv_case("K3"),
        _short_conv_case("TP8"),
        _kda_prefill_case("K3"),
        _kda_prefill_case("TP8"),
        *(_kda_chunk_case(phase, shape) for phase in ("prep", "intra", "state") for shape in SHAPES),
        *(_kda_chunk_case(phase, "K3", "f16") for phase in ("intra", "state")),  # fp32 intermediates and MFMA
        _quant_case(LATENT, "bf16"),
        _quant_case(3072, "f32"),
        _quant_case(384, "f32"),
        _reduce_case(),
        _route_case(896, TOP_K, True),  # K3 router
        _route_case(256, 8, False),  # Kimi Linear shape, no bias
        _gated_act_case(2 * 3072, "situ"),  # K3 shared experts (2 x 3072 intermediate)
        _gated_act_case(2 * 3072 // 8, "situ"),  # ... TP-8 shard
        _gated_act_case(33792 // 8, "silu"),  # dense layer 0 intermediate, TP-8 shard (Kimi Linear uses SiLU)
        _mla_prefill_case(True, True, "bf16"),  # one segment, K3's output gate
        _mla_prefill_case(True, False, None),  # first of several segments: writes the state
        _mla_prefill_case(False, True, "f32"),  # last segment: reads the state, gates, stores
    ]
    for shape in SHAPES:
        for stage in (1, 2):
            for fmt in ("bf16", "fp8"):
                cases.append(_moe_case(shape, stage, fmt))
    cases.append(_moe_case("K3", 2, "bf16", split_k=4))  # w2 split in K at decode (T = 1 on a 304-CU MI300X)
    return cases


CASES = _cases()


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_compiles_with_clean_isa(case: Case, arch: str) -> None:
    result = compile_launcher(case.build(arch), case.args(), arch)
    assert not result.llvm_errors, f"{case.id} [{arch}]: LLVM reported errors: {result.llvm_errors[:3]}"
    assert len(result.kernels) == case.kernels, [k.name for k in result.kernels]
    for kernel in result.kernels:
        _check_kernel(case, arch, kernel)
    budget = case.k_loop(arch)
    if budget is not None:
        loop_weights, all_weights, per_weight, per_weight_unrolled, banned = budget
        k_loop = next((lp for listing in result.listings for lp in loops(listing)
                       if any(m.startswith("v_mfma") for m in lp)), None)
        if k_loop is None:  # unrolled: the whole kernel
            k_loop, loop_weights, per_weight = result.kernels[0].mnemonics, all_weights, per_weight_unrolled
        valu = sum(n for m, n in k_loop.items() if m.startswith("v_") and not m.startswith("v_mfma"))
        assert valu / loop_weights <= per_weight, f"{case.id} [{arch}]: {valu / loop_weights:.2f} VALU/weight {k_loop}"
        assert not [m for m in k_loop if m.startswith(banned)] if banned else True, f"{case.id}: {k_loop}"


def _check_kernel(case: Case, arch: str, kernel: KernelIsa) -> None:
    assert kernel.arch == arch
    assert not kernel.uses_scratch, f"scratch or spills: {kernel.summary()}"
    assert kernel.vgpr_count <= case.vgpr_budget, f"VGPR budget {case.vgpr_budget} exceeded: {kernel.summary()}"
    if case.lds_budget is not None:
        assert kernel.lds_size <= case.lds_budget, f"LDS budget {case.lds_budget} B exceeded: {kernel.summary()}"
    # a per-lane buffer descriptor (or any divergent loop) shows up as an exec-mask loop: none is intended
    assert "s_cbranch_execnz" not in kernel.mnemonics, f"waterfall/divergent loop: {kernel.summary()}"
    if case.load is not None:
        assert case.load in kernel.mnemonics, f"expected {case.load} accesses: {sorted(kernel.mnemonics)}"
    for mnemonic in case.also(arch):
        assert mnemonic in kernel.mnemonics, f"expected {mnemonic}: {kernel.summary()}"
    expected = case.mfma(arch)
    if expected is None:
        assert not kernel.has("v_mfma"), f"unexpected matrix instructions: {kernel.summary()}"
    else:
        assert kernel.has(expected), f"expected {expected}: {kernel.summary()}"
        others = [m for m in kernel.matching("v_mfma") if not m.startswith(expected)]
        assert not others, f"{case.id} [{arch}] uses other matrix instructions {others}"
