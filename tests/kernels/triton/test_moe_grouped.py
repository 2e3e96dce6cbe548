"""The grouped MoE prefill path (rocm_k3.triton_kernels.moe.grouped): dequantised MXFP4 experts + torch._grouped_mm.

Tiers as in test_triton_ops.py: ``interpret`` (TRITON_INTERPRET=1 on the CPU: the dequant kernel against the
reference dequantisation, the whole path against ``fused_moe_reference``), unit (the selection rule), ``cuda``
(K3 widths on the H200 against the reference and the warp-specialised path).

Tolerances (relative L2 error): the dequant kernel 0 (E2M1 x 2^e is exact in bf16); the whole path with bf16 x
A16W4 1.5e-2 in the interpreter (bf16 w13 output, intermediate and w2 output, each rounded once more than in the
fp32 reference, and the interpreter's truncating fp32 -> bf16 casts; measured 6.8e-3) and 5e-3 on the GPU (the
fused path's tolerance in test_fused_moe_k3_cuda); A8W4 3e-2 everywhere: the bf16 w13 output flips the MXFP8
rounding of a few % of the intermediate values by one E4M3 step (measured 2.0e-2 in the interpreter, the same as a
torch emulation of "round h to bf16, then activate and round to MXFP8" gives; the fused path, activating fp32,
has 4e-3); 5e-3 against the ws path (A16W4: the same decoded weights and activation math, the grouped path rounds
the w13 and w2 outputs to bf16 where ws keeps fp32).
"""

import dataclasses
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import: see test_triton_ops.py

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from rocm_k3.ops.moe import ExpertWeights, MoEActivation  # noqa: E402
from rocm_k3.ops.moe_reference import fused_moe_reference  # noqa: E402
from rocm_k3.quant.mxfp4 import dequantize_mxfp4_reference  # noqa: E402
from rocm_k3.settings import Settings  # noqa: E402
from rocm_k3.triton_kernels.moe import grouped  # noqa: E402
from rocm_k3.triton_kernels.moe.decode import _half_value  # noqa: E402
from rocm_k3.triton_kernels.moe.fused import fused_moe_with, prepare_weights  # noqa: E402
from rocm_k3.triton_kernels.runtime import interpreted  # noqa: E402
from tests.helpers import assert_rel, poisoned_like, run_interpret_tier, seeded  # noqa: E402
from tests.helpers import moe_routing as _routing  # noqa: E402
from tests.helpers import mxfp4_experts as _experts  # noqa: E402

_INTERPRETED = interpreted(grouped.dequant_kernel) and interpreted(triton.language.sigmoid)
needs_interp = pytest.mark.skipif(not _INTERPRETED, reason="kernels are compiled in this process; the interpreter "
                                                           "tier runs in test_interpret_tier_in_subprocess")
FP8 = {"ocp": torch.float8_e4m3fn, "fnuz": torch.float8_e4m3fnuz}
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm") and grouped._torch_version() >= grouped.MIN_TORCH
needs_grouped_mm = pytest.mark.skipif(not _HAS_GROUPED_MM, reason=f"torch {torch.__version__} lacks a usable "
                                                                  f"_grouped_mm (the path needs torch >= 2.9)")


def _check_dequant(weights: ExpertWeights, prepared: ExpertWeights, experts: list[int],
                   tile: grouped.DequantTile | None = None) -> None:
    """dequantize() of ``experts`` into NaN-poisoned buffers equals the reference dequantisation bit for bit."""
    dev = prepared.device
    n, k, kout = weights.intermediate, weights.hidden, weights.out_features
    ids = torch.tensor(experts, dtype=torch.int32, device=dev)
    for which, shape, codes, scales in (("w13", (2 * n, k), weights.w13, weights.w13_scale),
                                        ("w2", (kout, n), weights.w2, weights.w2_scale)):
        out = poisoned_like(torch.empty(len(experts), *shape, dtype=torch.bfloat16, device=dev))
        grouped.dequantize(prepared, which, ids, out, tile)
        ref = dequantize_mxfp4_reference(codes[experts], scales[experts], torch.float32)
        assert not out.isnan().any(), f"{which}: unwritten (NaN) elements"
        # bit for bit: torch.equal equates +-0, and code 8 (-0) is where decodes part (Triton <= 3.6 built a
        # float ``-v`` as ``0 - v``, +0 for v = +0; the reference and the bit-built decode keep -0)
        same = out.view(torch.int16) == ref.to(torch.bfloat16).view(torch.int16)  # exact: 2 significant bits
        assert bool(same.all()), f"{which}: {int((~same).sum())} dequantised weights differ from the reference " \
                                 f"in their bits (signs of zero included) ({tile})"


# ------------------------------------------------------------------------------------------------- interpret tier
@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("e,n,k,kout", [(3, 64, 128, 128), (4, 96, 160, 96)], ids=["even", "padded"])
def test_dequant_kernel_interpret(e: int, n: int, k: int, kout: int) -> None:
    """The dequant kernel on random experts, whole and padded layout tiles (N 96 < 128 rows of
    w2's K, K 160 and Kout 96 < their 128 multiples), experts in a shuffled order with a repeat."""
    weights = _experts(e, n, k, kout, seeded(1))
    _check_dequant(weights, prepare_weights(weights), [e - 1, 0, e - 1])


@triton.jit
def _half_value_probe(o_ptr, s_ptr, out_ptr, N: tl.constexpr):
    """out[0, i] / out[1, i] = decode._half_value of the low / high half of word o[i], times scale s[i]."""
    i = tl.arange(0, N)
    o = tl.load(o_ptr + i)
    s = tl.load(s_ptr + i)
    tl.store(out_ptr + i, _half_value(o, False, s))
    tl.store(out_ptr + N + i, _half_value(o, True, s))


@pytest.mark.interpret
@needs_interp
def test_half_value_exact_for_every_code_and_scale() -> None:
    """The bit-built decode against the E2M1 table: all 16 x 16 (low, high) codes of a word, placed as the masks
    leave them (sign 15, exponent 8..7, mantissa 6 of each half), times every E8M0 scale 2^-127 .. 2^127, bit
    for bit in fp32 (signed zeros included)."""
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def half_bits(code: int) -> int:  # the code's bits where the decode's masks leave them in a bf16 half
        return ((code & 8) << 12) | (((code >> 1) & 3) << 7) | ((code & 1) << 6)

    words, values = [], []
    for lo in range(16):
        for hi in range(16):
            words.append(half_bits(lo) | (half_bits(hi) << 16))
            values.append([(-1.0 if c & 8 else 1.0) * table[c & 7] for c in (lo, hi)])
    words = torch.tensor(words, dtype=torch.int64).to(torch.int32)  # [256] (the top bit wraps to int32's sign)
    values = torch.tensor(values, dtype=torch.float64)  # [256, 2]
    for s in range(0, 255, 1):
        scale = torch.full((256,), 2.0 ** (s - 127), dtype=torch.float64)
        out = torch.full((2, 256), float("nan"), dtype=torch.float32)
        _half_value_probe[(1,)](words, scale.to(torch.float32), out, N=256)
        ref = (values * scale[:, None]).to(torch.float32).t()  # exact: E2M1 x 2^e fits fp32 (subnormals included)
        same = out.view(torch.int32) == ref.view(torch.int32)
        assert bool(same.all()), f"scale byte {s}: {int((~same).sum())} values differ, e.g. words " \
                                 f"{words[~same.any(0)][:4].tolist()}"


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("tile", [grouped.DequantTile(4, 8), grouped.DequantTile(2, 2)], ids=["ku4-w8", "ku2-w2"])
def test_dequant_tiles_and_extreme_scales_interpret(tile: grouped.DequantTile) -> None:
    """Other launch shapes (KU 4 on K groups it divides and falls back from on 3 groups) on random codes with
    scale bytes 3 .. 254 (tiny to huge scales, overflow to inf included), against the reference. Bytes 0 .. 2
    (bf16 subnormal weights) are left out here: the interpreter's fp32 -> bf16 cast flushes them to zero, before
    and after this decode alike; the fp32 values are checked for every byte above."""
    g = seeded(5)
    e, n, k, kout = 2, 64, 384, 256  # w13 K 384 = 3 groups (KU 4 falls back), w2 K 64 -> 1 padded group

    def mat(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(3, 255, (e, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        return codes, scales

    (w13, s13), (w2, s2) = mat(2 * n, k), mat(kout, n)
    weights = ExpertWeights("mxfp4", w13, s13, w2, s2)
    prepared = prepare_weights(weights)
    ids = torch.tensor([1, 0], dtype=torch.int32)
    for which, shape, codes, scales in (("w13", (2 * n, k), w13, s13), ("w2", (kout, n), w2, s2)):
        out = poisoned_like(torch.empty(e, *shape, dtype=torch.bfloat16))
        grouped.dequantize(prepared, which, ids, out, tile)
        ref = dequantize_mxfp4_reference(codes[[1, 0]], scales[[1, 0]], torch.float32)
        assert not out.isnan().any(), f"{which}: unwritten (NaN) elements"
        same = out.float().view(torch.int32) == ref.to(torch.bfloat16).float().view(torch.int32)
        assert bool(same.all()), f"{which}: {int((~same).sum())} dequantised weights differ from the reference"


def test_dequant_tile_validation() -> None:
    with pytest.raises(ValueError, match="ku"):
        grouped.DequantTile(ku=3)
    with pytest.raises(ValueError, match="num_warps"):
        grouped.DequantTile(num_warps=6)
    with pytest.raises(TypeError, match="DequantTile"):
        grouped.dequantize(None, "w13", torch.zeros(1, dtype=torch.int32), torch.empty(0), tile=(2, 4))


@needs_grouped_mm
@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("act,aq,fp8,scratch", [("situ", "bf16", None, False), ("silu", "bf16", None, True),
                                                ("situ", "mxfp8", "ocp", False), ("situ", "mxfp8", "fnuz", True)],
                         ids=["situ-A16W4", "silu-A16W4-groups", "situ-A8W4-ocp", "situ-A8W4-fnuz-groups"])
def test_grouped_path_interpret(act: str, aq: str, fp8: str | None, scratch: bool,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """gemm="grouped" against the reference on an odd shape (T 7, top-3 of 5 experts, N 96, K 160, Kout 96), in
    one expert group or one expert per group (a zero scratch budget)."""
    if scratch:  # a zero budget: one used expert per group
        monkeypatch.setattr(grouped, "get_settings", lambda: types.SimpleNamespace(moe_grouped_scratch_mib=0))
    g = seeded(3)
    t, top_k, e, n, k, kout = 7, 3, 5, 96, 160, 96
    weights = _experts(e, n, k, kout, g)
    prepared = prepare_weights(weights)
    tw, ids = _routing(t, e, top_k, g)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    kw = dict(activation=MoEActivation(act), act_quant=aq, fp8_dtype=FP8.get(fp8))
    out = fused_moe_with(x, prepared, tw, ids, gemm="grouped", **kw)
    assert out.dtype == torch.bfloat16
    assert_rel(out, fused_moe_reference(x, weights, tw, ids, **kw), 3e-2 if aq == "mxfp8" else 1.5e-2, "grouped")


@pytest.mark.interpret
@pytest.mark.skipif(_INTERPRETED or torch.cuda.is_available(),
                    reason="the interpreter tier ran in this process (or a GPU is present)")
def test_interpret_tier_in_subprocess() -> None:
    run_interpret_tier(__file__)


# ------------------------------------------------------------------------------------------------------ unit tier
def test_plan_groups_used_experts() -> None:
    """Groups hold only used experts, at most per_group each, with their rows of the 16-row aligned layout."""
    start, count = [0, 16, 16, 48, 48], [3, 0, 17, 0, 1]
    assert grouped._plan(start, count, 2) == [([0, 2], 0, 48), ([4], 48, 64)]
    assert grouped._plan(start, count, 8) == [([0, 2, 4], 0, 64)]


@needs_grouped_mm  # (the version gate is test_torch_version_gate's)
def test_selection_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default picks the grouped path only at >= MIN_ROWS_PER_EXPERT rows per expert, bf16 x, MXFP4 experts,
    and only where the platform allows (never on the CPU / in the interpreter)."""
    weights = _experts(32, 32, 64, 64, seeded(0))
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not grouped.platform_allows(x)  # CPU
    assert not grouped.auto_selects(x, weights, 1 << 20, 16, "bf16")
    monkeypatch.setattr(grouped, "platform_allows", lambda x: True)
    at = int(grouped.MIN_ROWS_PER_EXPERT * 32 / 16)  # tokens giving exactly the threshold at top-16 over 32
    assert grouped.auto_selects(x, weights, at, 16, "bf16")
    assert not grouped.auto_selects(x, weights, at, 16, "mxfp8")  # A8W4: explicit only (module doc)
    assert not grouped.auto_selects(x, weights, at - 1, 16, "bf16")
    assert not grouped.auto_selects(x.float(), weights, at, 16, "bf16")
    bf16_experts = ExpertWeights("bf16", torch.zeros(32, 64, 64), None, torch.zeros(32, 64, 32), None)
    assert not grouped.auto_selects(x, bf16_experts, at, 16, "bf16")
    odd = _experts(32, 32, 64, 68, seeded(0))  # Kout 68: w2 output rows of 136 bytes, not 16-byte multiples
    assert not grouped.auto_selects(x, odd, at, 16, "bf16")


@pytest.mark.parametrize("version,ok", [("2.8.0", False), ("2.8rc1", False), ("2.8.0a0+git1", False),
                                        ("2.9.0+cu130", True), ("2.11.0a0+git1234", True), ("3.0.0", True)])
def test_torch_version_gate(monkeypatch: pytest.MonkeyPatch, version: str, ok: bool) -> None:
    """Below torch 2.9 the grouped path is refused by name and never selected."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch, "_grouped_mm", getattr(torch, "_grouped_mm", None), raising=False)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    weights = prepare_weights(_experts(4, 32, 64, 64, seeded(0)))
    problem = grouped._operand_problem(x, weights)
    assert (problem is None) == ok, problem
    if not ok:
        tw, ids = _routing(3, 4, 2, seeded(1))
        with pytest.raises(ValueError, match="needs torch >= 2.9"):
            fused_moe_with(x, weights, tw, ids, gemm="grouped")
        monkeypatch.setattr(grouped, "platform_allows", lambda x: True)
        assert not grouped.auto_selects(x, weights, 1 << 20, 16, "bf16")


@needs_grouped_mm  # (the version gate is test_torch_version_gate's)
def test_grouped_refuses_what_it_cannot_run() -> None:
    weights = prepare_weights(_experts(4, 32, 64, 64, seeded(0)))
    tw, ids = _routing(3, 4, 2, seeded(1))
    with pytest.raises(ValueError, match="x must be bf16"):
        fused_moe_with(torch.zeros(3, 64), weights, tw, ids, gemm="grouped")
    with pytest.raises(ValueError, match="gemm must be"):
        fused_moe_with(torch.zeros(3, 64, dtype=torch.bfloat16), weights, tw, ids, gemm="bogus")
    with pytest.raises(ValueError, match="MOE_GROUPED_SCRATCH_MIB"):
        Settings(moe_grouped_scratch_mib=0)
    with pytest.raises(ValueError, match="not an integer"):
        Settings.from_env({"ROCM_K3_MOE_GROUPED_SCRATCH_MIB": "2G"})
    assert Settings.from_env({"ROCM_K3_MOE_GROUPED_SCRATCH_MIB": "64"}).moe_grouped_scratch_mib == 64


# ------------------------------------------------------------------------------------------------------ cuda tier
def _k3_width_experts(e: int) -> ExpertWeights:
    """K3-width MXFP4 experts (hidden 3584, N 3072) with random codes and scales 2^-9..2^-5."""
    gd = torch.Generator(device="cuda").manual_seed(7)
    n, k = 3072, 3584
    w13 = torch.randint(0, 256, (e, 2 * n, k // 2), dtype=torch.uint8, device="cuda", generator=gd)
    w2 = torch.randint(0, 256, (e, k, n // 2), dtype=torch.uint8, device="cuda", generator=gd)
    s13 = torch.randint(118, 123, (e, 2 * n, k // 32), dtype=torch.uint8, device="cuda", generator=gd)
    s2 = torch.randint(118, 123, (e, k, n // 32), dtype=torch.uint8, device="cuda", generator=gd)
    return ExpertWeights("mxfp4", w13, s13, w2, s2)


def _poison_allocator() -> None:
    """Fill the caching allocator's free blocks with NaN, so an intermediate the path forgets to write shows."""
    free = torch.cuda.mem_get_info()[0]
    block = torch.full((min(free // 4, 8 << 30) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del block


@pytest.mark.cuda
def test_dequant_tiles_k3_cuda() -> None:
    """Every launch shape bench_dequant.py times, compiled for the GPU, at K3 widths (4 experts; scale bytes 3..254:
    tiny to huge scales), equal to the reference dequantisation."""
    weights = _k3_width_experts(4)
    gd = torch.Generator(device="cuda").manual_seed(8)
    weights = dataclasses.replace(weights, **{
        name: torch.randint(3, 255, getattr(weights, name).shape, dtype=torch.uint8, device="cuda", generator=gd)
        for name in ("w13_scale", "w2_scale")})
    prepared = prepare_weights(weights)
    for ku, warps in ((2, 4), (2, 8), (2, 16), (4, 8), (4, 16)):
        _check_dequant(weights, prepared, [3, 0, 2], grouped.DequantTile(ku, warps))


@needs_grouped_mm
@pytest.mark.cuda
def test_grouped_k3_cuda() -> None:
    """E 32, top-16, T 2048 at K3 widths: the grouped path against the reference (A16W4, A8W4 OCP) and the ws
    path; the dequant kernel compiled for the GPU equals the reference dequantisation; a small scratch (groups of 3
    experts) gives the same bits as one group; the default picks it here (2048 x 16 / 32 = 1024 rows per expert)."""
    weights = _k3_width_experts(32)
    prepared = prepare_weights(weights)
    _check_dequant(weights, prepared, [31, 0, 5])
    g = seeded(11)
    tw, ids = _routing(2048, 32, 16, g, "cuda")
    x = (torch.randn(2048, 3584, generator=g)).to("cuda", torch.bfloat16)
    _poison_allocator()
    out = fused_moe_with(x, prepared, tw, ids, gemm="grouped")
    assert grouped.auto_selects(x, prepared, 2048, 16, "bf16") == grouped.rows_rule(2048, 16, 32)
    # the default takes the grouped path here: bit-equal to it (the ws path rounds differently)
    assert torch.equal(fused_moe_with(x, prepared, tw, ids), out), "the default did not take the grouped path"
    ref = fused_moe_reference(x, weights, tw, ids, activation=MoEActivation())
    assert_rel(out, ref, 5e-3, "grouped A16W4")
    assert_rel(out, fused_moe_with(x, prepared, tw, ids, gemm="ws"), 5e-3, "grouped vs ws")
    assert torch.equal(out, fused_moe_with(x, prepared, tw, ids, gemm="grouped")), "not deterministic"
    small = 3 * 2 * 2 * 3072 * 3584  # bytes of 3 experts' w13 in bf16
    _poison_allocator()
    out_small = grouped.fused_moe_grouped(x, prepared, tw, ids, torch.empty_like(out), activation=MoEActivation(),
                                          out_mx=None, fast_act=True, scratch_bytes=small)
    assert torch.equal(out_small, out), "expert groups change the result"
    kw = dict(activation=MoEActivation(), act_quant="mxfp8", fp8_dtype=torch.float8_e4m3fn)
    assert_rel(fused_moe_with(x, prepared, tw, ids, gemm="grouped", **kw),
               fused_moe_reference(x, weights, tw, ids, **kw), 3e-2, "grouped A8W4")


@needs_grouped_mm
@pytest.mark.cuda
def test_grouped_unused_experts_cuda() -> None:
    """Experts with no rows (before, between and after the used ones) in the one-group path (zero-row groups handed
    to torch._grouped_mm on the device) and in the several-group path (host-planned used experts), against the
    reference: E 12, the tokens routed to 6 of them only."""
    g = seeded(13)
    weights = _experts(12, 96, 160, 96, g, "cuda")
    prepared = prepare_weights(weights)
    tw, ids = _routing(40, 6, 3, g, "cuda")
    ids = torch.tensor([1, 2, 4, 7, 8, 10], dtype=torch.int32, device="cuda")[ids.long()]  # used: 1 2 4 7 8 10
    x = torch.randn(40, 160, generator=g).to("cuda", torch.bfloat16)
    ref = fused_moe_reference(x, weights, tw, ids, activation=MoEActivation())
    one = fused_moe_with(x, prepared, tw, ids, gemm="grouped")
    assert_rel(one, ref, 5e-3, "grouped, one group with unused experts")
    per_expert = 2 * 2 * 96 * 160  # bf16 bytes of one expert's w13: one expert per group
    _poison_allocator()
    several = grouped.fused_moe_grouped(x, prepared, tw, ids, torch.empty_like(one), activation=MoEActivation(),
                                        out_mx=None, fast_act=True, scratch_bytes=per_expert)
    assert torch.equal(several, one), "expert groups change the result"


@needs_grouped_mm
@pytest.mark.cuda
def test_grouped_odd_shape_and_graph_capture_cuda() -> None:
    """An odd shape (T 37, top-5 of 9 experts, N 96, K 160, Kout 96: padded layout tiles) on the GPU, A16W4 / SiLU
    and A8W4 FNUZ, against the reference; inside CUDA-graph capture the default never picks the grouped path and an
    explicit request is refused before anything runs."""
    g = seeded(12)
    weights = _experts(9, 96, 160, 96, g, "cuda")
    prepared = prepare_weights(weights)
    tw, ids = _routing(37, 9, 5, g, "cuda")
    x = torch.randn(37, 160, generator=g).to("cuda", torch.bfloat16)
    for kw, tol in ((dict(activation=MoEActivation("silu")), 5e-3),
                    (dict(activation=MoEActivation(), act_quant="mxfp8", fp8_dtype=torch.float8_e4m3fnuz), 3e-2)):
        _poison_allocator()
        assert_rel(fused_moe_with(x, prepared, tw, ids, gemm="grouped", **kw),
                   fused_moe_reference(x, weights, tw, ids, **kw), tol, f"grouped {kw}")
    with pytest.raises(ValueError, match="decode='asm' does not apply"):
        fused_moe_with(x, prepared, tw, ids, gemm="grouped", decode="asm")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    seen = {}
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        seen["allows"] = grouped.platform_allows(x)
        seen["ok"] = grouped.supports(x, prepared, False)[0]
    assert not seen["allows"] and not seen["ok"]
