"""Host-side checks of the FlyDSL backend (unit tier, no compiler, no GPU).

- the thread -> element index maps the kernels are built from (``plans``) cover each tile exactly once with
  the intended vector widths;
- the MoE weight pre-shuffle places every FP4 code where the kernels' K map says, and round-trips exactly;
- expert alignment, the ISA parser, backend availability/dispatch choice and ``supports`` reasons.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from rocm_k3.flydsl_kernels import plans
from rocm_k3.flydsl_kernels.isa import parse_isa
from rocm_k3.flydsl_kernels.moe import align_pairs
from rocm_k3.flydsl_kernels.weights import LAYOUTS, preshuffle_codes, unshuffle_codes
from rocm_k3.ops.devices import DeviceInfo
from tests.helpers import seeded

# (D, vec) pairs the kernels use: norms (hidden, q/kv LoRA, head; 8 x bf16 or 4 x fp32 per access),
# attn_res (64-bit accesses) and the MoE top-k reduction (4 x fp32).
ROW_SHAPES = [(7168, 8), (1536, 8), (512, 8), (128, 8), (128, 4), (7168, 4), (3584, 4), (256, 8)]


@pytest.mark.parametrize("D,vec", ROW_SHAPES, ids=[f"D{d}-vec{v}" for d, v in ROW_SHAPES])
def test_row_plan_covers_block_exactly_once(D: int, vec: int) -> None:
    plan = plans.row_plan(D, vec)
    seen = collections.Counter()
    for tid in range(plan.threads):
        row = plan.row_of(tid)
        for tile in range(plan.tiles):
            v = plan.vector_of(tid, tile)
            assert 0 <= v < D // vec
            seen.update((row, v * vec + e) for e in range(vec))  # one vec-wide, vec-aligned access
    expected = {(r, c) for r in range(plan.rows_per_block) for c in range(D)}
    assert set(seen) == expected
    assert set(seen.values()) == {1}
    assert plan.threads % 64 == 0 and plan.threads <= 256


@pytest.mark.parametrize("rows,N,vec", [(9, 6144, 8), (5, 768, 8), (3, 4224, 8), (7, 24, 4)],
                         ids=["R9-N6144", "R5-N768", "R3-N4224", "R7-N24-fp32"])
def test_flat_vectors_cover_rows_once_within_block_span(rows: int, N: int, vec: int) -> None:
    """The element-wise map of gated_act: each lane one vector, every block inside its descriptor's span."""
    per_row, lanes = N // vec, 256
    span = (lanes - 1) // per_row + 2
    seen = collections.Counter()
    total = rows * per_row
    for idx in range(total):
        r, c = plans.flat_vector_coord(idx, per_row, vec)
        r0, _ = plans.flat_vector_coord(idx // lanes * lanes, per_row, vec)
        assert 0 <= r - r0 < span
        seen.update((r, c + e) for e in range(vec))
    assert set(seen) == {(r, c) for r in range(rows) for c in range(N)} and set(seen.values()) == {1}


def test_route_lanes_hold_each_expert_once() -> None:
    E, lanes = 896, 256
    held = collections.Counter(plans.route_expert(lane, slot, lanes) for lane in range(lanes)
                               for slot in range((E + lanes - 1) // lanes))
    assert {e for e in held if e < E} == set(range(E)) and set(held.values()) == {1}


def test_route_order_is_the_references_stable_descending_sort() -> None:
    pytest.importorskip("flydsl")
    from rocm_k3.flydsl_kernels.route import _better

    g = seeded(21)
    keys = (torch.randint(0, 6, (40,), generator=g).float() / 4).tolist()  # many ties
    remaining = list(range(len(keys)))
    order = []
    while remaining:  # repeated arg-max under the kernel's comparison, any reduction order
        best = remaining[0]
        for i in remaining[1:]:
            if _better(keys[best], best, keys[i], i):
                best = i
        order.append(best)
        remaining.remove(best)
    assert order == torch.sort(torch.tensor(keys), descending=True, stable=True).indices.tolist()


def test_row_plan_rejects_untileable_rows() -> None:
    with pytest.raises(ValueError, match="multiple of the vector width"):
        plans.row_plan(100, 8)
    with pytest.raises(ValueError, match="64"):
        plans.row_plan(8 * 96, 8)  # 96 vectors: not a multiple of 64 lanes


@pytest.mark.parametrize("K", plans.KDA_HEAD_DIMS)
def test_kda_decode_lanes_cover_state_tile_once(K: int) -> None:
    seen = collections.Counter()
    for tid in range(plans.KDA_LANES_PER_COLUMN * K):
        c, half = plans.kda_decode_lane(tid)
        seen.update((plans.kda_decode_row(half, i, K), c) for i in range(K // plans.KDA_LANES_PER_COLUMN))
    assert set(seen) == {(r, c) for r in range(K) for c in range(K)}
    assert set(seen.values()) == {1}
    # the two lanes of a column are xor-1 neighbours (their partial dots meet with shuffle_xor(1))
    assert all(plans.kda_decode_lane(t)[0] == plans.kda_decode_lane(t ^ 1)[0] for t in range(2 * K))


def test_mfma_c_fragment_covers_tile_once() -> None:
    seen = collections.Counter(plans.mfma_c_coord(lane, i) for lane in range(64) for i in range(4))
    assert set(seen) == {(r, c) for r in range(16) for c in range(16)} and set(seen.values()) == {1}
    # the C column of a lane is the B row it supplies, so a per-column scale can be applied to the C fragment
    assert all(plans.mfma_c_coord(lane, 0)[1] == plans.mfma_ab_row(lane) for lane in range(64))


MFMA_K_MAPS = [("step", 4), ("step", 8), ("lane", 4), ("lane", 8), ("lane", 32)]


@pytest.mark.parametrize("layout,kpl", MFMA_K_MAPS, ids=[f"{lay}-kpl{k}" for lay, k in MFMA_K_MAPS])
def test_moe_operand_map_covers_k_group_once(layout: str, kpl: int) -> None:
    group = 3
    seen = collections.Counter()
    for lane, step, j in itertools.product(range(64), range(plans.moe_steps(kpl)), range(kpl)):
        seen[(plans.mfma_ab_row(lane), plans.moe_k_index(lane, group, step, j, layout, kpl))] += 1
    base = group * plans.MOE_K_GROUP
    assert set(seen) == {(r, base + k) for r in range(16) for k in range(plans.MOE_K_GROUP)}
    assert set(seen.values()) == {1}


@pytest.mark.parametrize("layout,kpl", MFMA_K_MAPS, ids=[f"{lay}-kpl{k}" for lay, k in MFMA_K_MAPS])
def test_moe_k_map_respects_mx_blocks(layout: str, kpl: int) -> None:
    for step in range(plans.moe_steps(kpl)):
        blocks_in_step = {plans.moe_k_index(lane, 0, step, j, layout, kpl) // 32
                          for lane in range(64) for j in range(kpl)}
        for lane in range(64):
            lane_blocks = {plans.moe_k_index(lane, 0, step, j, layout, kpl) // 32 for j in range(kpl)}
            assert len(lane_blocks) == 1, "a lane's fragment must lie in one MX block (one scale per lane)"
        if layout == "step":
            assert len(blocks_in_step) == 1, "a 'step' MFMA must stay inside one MX block (scale after the MFMA)"
        # the fragment is contiguous in the lane's pre-shuffled dwords, in MFMA order
        for lane, j in itertools.product(range(64), range(kpl)):
            d, p = plans.moe_dword_pos(step, j, layout, kpl)
            assert plans.moe_dword_k(lane, 0, d, p, layout) == plans.moe_k_index(lane, 0, step, j, layout, kpl)


def _random_mxfp4(E: int, R: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = seeded(seed)
    codes = torch.randint(0, 256, (E, R, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (E, R, K // 32), dtype=torch.uint8, generator=g)
    return codes, scales


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preshuffle_places_codes_where_kernels_read_them(layout: str) -> None:
    E, R, K = 2, 32, 256
    codes, scales = _random_mxfp4(E, R, K, seed=1)
    words, s = preshuffle_codes(codes, scales, layout)
    assert words.shape == (E, R // 16, K // 128, 64, 4) and words.dtype == torch.int32
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)  # [E, R, K] one code per k
    raw = words.view(torch.uint8).reshape(E, R // 16, K // 128, 64, 16)
    for e, tile, grp, lane, d, p in itertools.product(range(E), range(R // 16), range(K // 128), range(64),
                                                      range(4), range(8)):
        code = (int(raw[e, tile, grp, lane, 4 * d + p // 2]) >> (4 * (p % 2))) & 15
        k = plans.moe_dword_k(lane, grp, d, p, layout)
        assert code == int(nib[e, tile * 16 + lane % 16, k])
    for e, tile, grp, row, b in itertools.product(range(E), range(R // 16), range(K // 128), range(16), range(4)):
        assert s[e, tile, grp, row, b] == scales[e, tile * 16 + row, grp * 4 + b]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preshuffle_round_trips(layout: str) -> None:
    codes, scales = _random_mxfp4(3, 48, 384, seed=2)
    back_codes, back_scales = unshuffle_codes(*preshuffle_codes(codes, scales, layout), layout)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


def test_preshuffle_validates_shapes() -> None:
    codes, scales = _random_mxfp4(1, 24, 256, seed=3)
    with pytest.raises(ValueError, match="R % 16"):
        preshuffle_codes(codes, scales, "step")
    codes, scales = _random_mxfp4(1, 16, 256, seed=3)
    with pytest.raises(ValueError, match="layout"):
        preshuffle_codes(codes, scales, "diagonal")


def _expert_weights(E: int = 4, K: int = 256, N: int = 128, Kout: int = 256):
    from rocm_k3.ops.moe import ExpertWeights

    w13, s13 = _random_mxfp4(E, 2 * N, K, seed=4)
    w2, s2 = _random_mxfp4(E, Kout, N, seed=5)
    return ExpertWeights(fmt="mxfp4", w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_prepare_weights_round_trips(arch: str) -> None:
    from rocm_k3.flydsl_kernels.backend import prepare_weights, restore_weights

    weights = _expert_weights()
    prepared = prepare_weights(weights, arch=arch)
    assert prepared.layout == "flydsl" and prepared.extras["arch"] == arch
    assert prepared.extras["k_layout"] == ("step" if arch == "gfx942" else "lane")
    restored = restore_weights(prepared)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(restored, name), getattr(weights, name)), name


def test_prepare_weights_needs_an_arch_on_the_host() -> None:
    from rocm_k3.flydsl_kernels.backend import prepare_weights

    with pytest.raises(ValueError, match="arch"):
        prepare_weights(_expert_weights())


ALIGN_CASES = [(1, 1, 4), (7, 2, 4), (33, 8, 16), (5, 16, 896)]


@pytest.mark.parametrize("T,k,E", ALIGN_CASES, ids=[f"T{t}-k{k}-E{e}" for t, k, e in ALIGN_CASES])
def test_align_pairs_groups_every_pair_once(T: int, k: int, E: int) -> None:
    g = seeded(T * 100 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)  # distinct per token
    blocks = align_pairs(ids, E)
    pairs = blocks.sorted_pairs.tolist()
    experts = blocks.block_expert.tolist()
    assert blocks.num_pairs == T * k and len(pairs) == 16 * blocks.num_blocks == 16 * len(experts)
    real = [p for p in pairs if p != T * k]
    assert sorted(real) == list(range(T * k))
    flat = ids.reshape(-1).tolist()
    for b, e in enumerate(experts):
        for p in pairs[16 * b : 16 * b + 16]:
            assert p == T * k or flat[p] == e
    counts = collections.Counter(flat)
    assert blocks.num_blocks == sum((c + 15) // 16 for c in counts.values())
    assert experts == sorted(experts)


ISA_SNIPPET = """\t.amdgcn_target "amdgcn-amd-amdhsa--gfx942"
\t.text
my_kernel:
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], 0
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[8:9], v[10:11], v[0:3]
\tscratch_store_dword off, v1, s0
\ts_endpgm
.Lfunc_end0:
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     4
    .args:
      - .offset:         0
        .size:           8
    .group_segment_fixed_size: 512
    .name:           my_kernel
    .private_segment_fixed_size: 16
    .sgpr_count:     20
    .sgpr_spill_count: 0
    .vgpr_count:     40
    .vgpr_spill_count: 3
amdhsa.target:   amdgcn-amd-amdhsa--gfx942
"""


def test_isa_parser_reads_registers_spills_and_mnemonics() -> None:
    (kernel,) = parse_isa(ISA_SNIPPET)
    assert (kernel.name, kernel.arch) == ("my_kernel", "gfx942")
    assert (kernel.vgpr_count, kernel.agpr_count, kernel.sgpr_count) == (40, 4, 20)
    assert (kernel.vgpr_spill_count, kernel.private_segment_size, kernel.lds_size) == (3, 16, 512)
    assert kernel.mnemonics["v_mfma_f32_16x16x16_bf16"] == 2 and kernel.scratch_instructions == 1
    assert kernel.uses_scratch and kernel.has("v_mfma_f32_16x16x16") and not kernel.has("v_mfma_scale")


def test_isa_parser_rejects_listing_without_metadata() -> None:
    with pytest.raises(ValueError, match="metadata"):
        parse_isa('\t.amdgcn_target "amdgcn-amd-amdhsa--gfx950"\nk:\n\ts_endpgm\n')


def test_backend_available_only_on_rocm_gfx942_gfx950() -> None:
    pytest.importorskip("flydsl")
    from rocm_k3.flydsl_kernels.backend import available

    ok, why = available(DeviceInfo("cpu", None, "CPU"))
    assert not ok and "ROCm" in why and "CPU" in why
    ok, why = available(DeviceInfo("cuda", "sm_90", "H200"))
    assert not ok and "H200" in why
    ok, why = available(DeviceInfo("rocm", "gfx90a", "MI250X"))
    assert not ok and "gfx90a" in why
    assert available(DeviceInfo("rocm", "gfx942", "MI300X"))[0]
    assert available(DeviceInfo("rocm", "gfx950", "MI355X"))[0]


FLYDSL_OPS = ["rms_norm", "add_rms_norm", "gated_rms_norm", "attn_res_step", "kda_decode", "short_conv", "kda_prefill",
              "fused_moe", "route", "situ_and_mul", "silu_and_mul"]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_ops_listing_picks_flydsl_on_amd_and_explains_elsewhere(arch: str) -> None:
    pytest.importorskip("flydsl")
    from rocm_k3.ops import registry
    from rocm_k3.settings import override

    with override(backend="auto"):
        registry.backend_available("reference", DeviceInfo("cpu", None, "CPU"))  # declares the ops
        for op in FLYDSL_OPS:
            chosen, lines = registry.explain(op, DeviceInfo("rocm", arch, "AMD Instinct"))
            assert chosen == "flydsl", (op, lines)
    with override(backend="flydsl"):
        chosen, lines = registry.explain("fused_moe", DeviceInfo("cpu", None, "CPU"))
        assert chosen is None and "gfx942/gfx950" in lines[0]


def test_fused_moe_supports_explains_refusals() -> None:
    from rocm_k3.flydsl_kernels.moe import fused_moe_supports, prepare_weights

    weights = _expert_weights()
    x = torch.zeros(3, weights.hidden, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    tw = torch.ones(3, 2)
    ok, why = fused_moe_supports(x, weights, tw, ids)
    assert not ok and "prepare_weights" in why
    prepared = prepare_weights(weights, "gfx942")
    assert fused_moe_supports(x, prepared, tw, ids)[0]
    ok, why = fused_moe_supports(x, prepared, tw, ids, act_quant="mxfp8", fp8_dtype=torch.float8_e4m3fn)
    assert not ok and "float8_e4m3fnuz" in why
    ok, why = fused_moe_supports(x.float(), prepared, tw, ids)
    assert not ok and "bf16" in why


def test_prefill_segments_split_sequences_at_requested_positions() -> None:
    from rocm_k3.flydsl_kernels.ops_impl import _segments

    cu = torch.tensor([0, 5, 12, 12], dtype=torch.int32)  # lengths 5, 7, 0
    rows = torch.tensor([[1, 3], [0, 2], [1, 7], [1, 3]], dtype=torch.int32)
    ptr, start, end, row = (t.tolist() for t in _segments(cu, rows, torch.device("cpu")))
    assert ptr == [0, 2, 6, 7]
    assert list(zip(start, end, row)) == [
        (0, 2, 1), (2, 5, -1),  # seq 0: save after 2 tokens, then the final state
        (0, 3, 0), (3, 3, 3), (3, 7, 2), (7, 7, -1),  # seq 1: p=3 requested twice, p=7 = its length
        (0, 0, -1),  # empty seq 2: final state only
    ]
    for i in range(3):  # the segments of each sequence tile [0, len) in order
        seq = list(zip(start, end))[ptr[i] : ptr[i + 1]]
        assert seq[0][0] == 0 and seq[-1][1] == int(cu[i + 1] - cu[i])
        assert all(a[1] == b[0] for a, b in itertools.pairwise(seq))


def test_row_kernel_supports_explain_refusals() -> None:
    from rocm_k3.flydsl_kernels import ops_impl

    ok, why = ops_impl.rms_norm_supports(torch.zeros(2, 100, dtype=torch.bfloat16), torch.ones(100))
    assert not ok and "100" in why
    ok, why = ops_impl.gated_rms_norm_supports(torch.zeros(2, 4, 128, dtype=torch.bfloat16),
                                               torch.zeros(2, 4, 128), torch.ones(128))
    assert not ok and "gate dtype" in why
    assert ops_impl.rms_norm_supports(torch.zeros(2, 7168, dtype=torch.bfloat16), torch.ones(7168))[0]


# --- the bit formulas the MoE kernels trace (bitcodes), evaluated on Python ints -----------------------------

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # K3_SPEC section 6, codes 0..7; 8..15 negated


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_VALUES[code & 7]


def test_e2m1_decodes_to_bf16_bits_exactly() -> None:
    from rocm_k3.flydsl_kernels.bitcodes import e2m1_to_bf16_bits, py_select

    bits = torch.tensor([e2m1_to_bf16_bits(c, py_select) for c in range(16)], dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).float().tolist()
    assert values == [_e2m1(c) for c in range(16)]
    assert bits[8].item() == -32768  # code 8 is -0.0, kept as a negative zero


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fnuz, torch.float8_e4m3fn], ids=["fnuz", "ocp"])
def test_e2m1_maps_to_e4m3_bytes_exactly(fp8: torch.dtype) -> None:
    from rocm_k3.flydsl_kernels.bitcodes import e2m1_to_e4m3_byte, py_select

    fnuz = fp8 == torch.float8_e4m3fnuz
    codes = torch.tensor([e2m1_to_e4m3_byte(c, fnuz, py_select) for c in range(16)], dtype=torch.uint8)
    values = codes.view(fp8).float()
    assert torch.isfinite(values).all(), "FNUZ 0x80 is NaN: signed zeros must map to 0"
    assert values.tolist() == [_e2m1(c) if _e2m1(c) != 0 else 0.0 for c in range(16)]


def test_e8m0_bits_match_the_quant_decoder() -> None:
    from rocm_k3.flydsl_kernels.bitcodes import e8m0_to_f32_bits, py_select
    from rocm_k3.quant.e8m0 import decode_e8m0

    scales = torch.arange(255, dtype=torch.uint8)  # 0xFF is the NaN scale, never decoded by the kernels
    bits = torch.tensor([e8m0_to_f32_bits(int(s), py_select) for s in scales], dtype=torch.int32)
    assert torch.equal(bits.view(torch.float32), decode_e8m0(scales))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fnuz, torch.float8_e4m3fn], ids=["fnuz", "ocp"])
def test_mx_scale_exponent_matches_the_quant_rule(fp8: torch.dtype) -> None:
    from rocm_k3.flydsl_kernels.bitcodes import (
        mx_scale_exponent,
        pow2_neg_f32_bits,
        py_select,
    )
    from rocm_k3.quant.e8m0 import scale_exponent
    from rocm_k3.quant.mxfp8 import FP8_FORMATS

    emax = FP8_FORMATS[fp8].emax
    g = seeded(7)
    amax = torch.cat([
        torch.tensor([0.0, 1e-45, 1e-40, 1.0, 1.74999, 1.75, 1.9999, 2.0, 3.5, 7.0, 448.0, 3.0e38]),
        torch.exp2(torch.empty(2000).uniform_(-140.0, 127.0, generator=g)),
    ]).to(torch.float32)
    mine = torch.tensor([mx_scale_exponent(int(b), emax, py_select) for b in amax.view(torch.int32)])
    assert torch.equal(mine, scale_exponent(amax, emax, "ct").to(torch.int64))
    inv = torch.tensor([pow2_neg_f32_bits(int(e)) for e in mine], dtype=torch.int32).view(torch.float32)
    assert torch.equal(inv, torch.exp2(-mine.double()).float())


# --- the MoE GEMM tile schedule, emulated lane by lane on the host ------------------------------------------
# The emulation follows moe_gemm's K loop with the same plan functions (operand K map, dword positions, scale
# slots) and the pre-shuffled weights, using the MFMA semantics C[i][j] = sum_q sum_t A[q*16+i][t] B[q*16+j][t]
# (lane q*16+i supplies row/column i of lane group q); it is compared with dequantise-then-matmul.

MOE_SCHEDULES = [("step", 4, "bf16"), ("lane", 8, "bf16"), ("step", 8, "fp8"), ("lane", 32, "fp8")]


def _emulate_moe_tile(layout: str, kpl: int, fmt: str, a_val: torch.Tensor, a_scale: torch.Tensor,
                      words: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """One 16x16 output tile (weight tile 0 of expert 0) of the GEMM A [16, K] x W^T, fp64."""
    from rocm_k3.flydsl_kernels.bitcodes import e2m1_to_bf16_bits, py_select

    def e2m1(code: int) -> float:
        bits = torch.tensor([e2m1_to_bf16_bits(code, py_select)], dtype=torch.int32).to(torch.int16)
        return bits.view(torch.bfloat16).item()

    def pow2(byte: int) -> float:
        return 2.0 ** (int(byte) - 127)

    groups = a_val.shape[1] // plans.MOE_K_GROUP
    acc = torch.zeros(16, 16, dtype=torch.float64)
    for g in range(groups):
        for s in range(plans.moe_steps(kpl)):
            a_frag = torch.zeros(64, kpl, dtype=torch.float64)
            b_frag = torch.zeros(64, kpl, dtype=torch.float64)
            a_sc = torch.ones(64, dtype=torch.float64)
            b_sc = torch.ones(64, dtype=torch.float64)
            for lane in range(64):
                row = plans.mfma_ab_row(lane)
                slot = plans.moe_scale_slot(lane, s, layout, kpl)
                b_sc[lane] = pow2(w_scales[0, 0, g, row, slot])
                a_sc[lane] = pow2(a_scale[row, g * 4 + slot])
                for j in range(kpl):
                    d, p = plans.moe_dword_pos(s, j, layout, kpl)
                    a_frag[lane, j] = a_val[row, plans.moe_dword_k(lane, g, d, p, layout)]
                    b_frag[lane, j] = e2m1((int(words[0, 0, g, lane, d]) >> (4 * p)) & 15)
            if fmt == "bf16":  # weights scaled while decoding, activations as they are
                acc += torch.einsum("qit,qjt->ij", a_frag.view(4, 16, kpl), (b_frag * b_sc[:, None]).view(4, 16, kpl))
            elif layout == "step":  # gfx942 FP8: unscaled MFMA, both scales on the fp32 result of the step
                tmp = torch.einsum("qit,qjt->ij", a_frag.view(4, 16, kpl), b_frag.view(4, 16, kpl))
                acc += tmp * a_sc[:16, None] * b_sc[None, :16]  # one MX block per step: lane group 0 has it
            else:  # gfx950 scaled MFMA: one E8M0 scale per lane and operand
                acc += torch.einsum("qit,qjt->ij", (a_frag * a_sc[:, None]).view(4, 16, kpl),
                                    (b_frag * b_sc[:, None]).view(4, 16, kpl))
    return acc


@pytest.mark.parametrize("layout,kpl,fmt", MOE_SCHEDULES, ids=[f"{lay}-kpl{k}-{f}" for lay, k, f in MOE_SCHEDULES])
def test_moe_tile_schedule_reproduces_the_gemm(layout: str, kpl: int, fmt: str) -> None:
    from rocm_k3.quant.mxfp4 import dequantize_mxfp4_reference
    from rocm_k3.quant.mxfp8 import dequantize_mxfp8_reference, quantize_mxfp8_reference

    K = 256
    codes, scales = _random_mxfp4(1, 16, K, seed=11)
    words, w_scales = preshuffle_codes(codes, scales, layout)
    x = torch.randn(16, K, generator=seeded(12))
    if fmt == "bf16":
        a_val, a_scale = x.to(torch.bfloat16).double(), torch.full((16, K // 32), 127, dtype=torch.uint8)
        a_ref = a_val
    else:
        q, a_scale = quantize_mxfp8_reference(x, torch.float8_e4m3fnuz)
        a_val = q.double()  # the fp8 code values; their scales are applied by the schedule
        a_ref = dequantize_mxfp8_reference(q, a_scale).double()
    ref = a_ref @ dequantize_mxfp4_reference(codes[0], scales[0], torch.float64).T  # [16, 16]
    out = _emulate_moe_tile(layout, kpl, fmt, a_val, a_scale, words, w_scales)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(code: int) -> float:
    return -E2M1_VALUES[code & 7] if code & 8 else E2M1_VALUES[code & 7]


def _words_with_every_code(seed: int) -> list[int]:
    """Dwords in which every nibble position sees every one of the 16 codes, plus random ones."""
    g = seeded(seed)
    words = [sum(((c + p) % 16) << (4 * p) for p in range(8)) for c in range(16)]
    return words + [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31 - 1, (512,), generator=g)]


def test_byte_lookup_bf16_decode_is_exact() -> None:
    """gfx942's v_perm_b32 decode (bitcodes.e2m1x8_to_bf16_pairs, with the instruction emulated by py_perm) gives
    bf16 pairs (n0, n2), (n4, n6), (n1, n3), (n5, n7) equal to the E2M1 values of the nibbles."""
    from rocm_k3.flydsl_kernels.bitcodes import e2m1x8_to_bf16_pairs, py_perm

    for w in _words_with_every_code(40):
        nib = [(w >> (4 * p)) & 15 for p in range(8)]
        for out, (a, b) in zip(e2m1x8_to_bf16_pairs(w, py_perm), ((0, 2), (4, 6), (1, 3), (5, 7))):
            assert (_bf16_value(out), _bf16_value(out >> 16)) == (_e2m1(nib[a]), _e2m1(nib[b])), hex(w)
    with pytest.raises(ValueError, match="selector"):
        py_perm(0, 0, 0x0D)


def test_byte_lookup_fnuz_decode_is_exact_and_never_nan() -> None:
    from rocm_k3.flydsl_kernels.bitcodes import e2m1x8_to_fnuz_words, py_perm

    for w in _words_with_every_code(41):
        nib = [(w >> (4 * p)) & 15 for p in range(8)]
        even, odd = e2m1x8_to_fnuz_words(w, py_perm)
        got = torch.tensor([(x >> (8 * i)) & 255 for x in (even, odd) for i in range(4)], dtype=torch.uint8)
        assert 0x80 not in got.tolist(), f"FNUZ NaN byte for {w:#x}"
        want = [_e2m1(nib[p]) for p in plans.STEP_FP8_NIBBLE]
        assert got.view(torch.float8_e4m3fnuz).float().tolist() == want, hex(w)


def test_e8m0_scale_by_max_matches_the_select_form() -> None:
    from rocm_k3.flydsl_kernels.bitcodes import e8m0_to_f32_bits, e8m0_to_f32_bits_by_max, py_select

    assert all(e8m0_to_f32_bits_by_max(b, max) == e8m0_to_f32_bits(b, py_select) for b in range(255))


def test_gfx942_bf16_schedule_with_accumulator_scaling_reproduces_the_gemm() -> None:
    """The gfx942 A16W4 K loop as moe_gemm runs it: per MX block (dword d) the byte-lookup decode's pairs are the
    two MFMA 16x16x16 B fragments ([p0, p2] for K offsets 0..3, [p1, p3] for 4..7), activations in K order
    (plans.moe_k_index), the two steps into a zeroed temporary, then ``acc += tmp * 2^(s - 127)`` per block."""
    from rocm_k3.flydsl_kernels.bitcodes import e2m1x8_to_bf16_pairs, py_perm
    from rocm_k3.quant.mxfp4 import dequantize_mxfp4_reference

    K = 256
    codes, scales = _random_mxfp4(1, 16, K, seed=13)
    words, w_scales = preshuffle_codes(codes, scales, "step")
    a_val = torch.randn(16, K, generator=seeded(14)).to(torch.bfloat16).double()
    ref = a_val @ dequantize_mxfp4_reference(codes[0], scales[0], torch.float64).T
    acc = torch.zeros(16, 16, dtype=torch.float64)
    for g in range(K // plans.MOE_K_GROUP):
        for d in range(4):
            tmp = torch.zeros(16, 16, dtype=torch.float64)
            for sub in range(2):
                step = 2 * d + sub
                a_frag = torch.zeros(64, 4, dtype=torch.float64)
                b_frag = torch.zeros(64, 4, dtype=torch.float64)
                for lane in range(64):
                    pairs = e2m1x8_to_bf16_pairs(int(words[0, 0, g, lane, d]) & 0xFFFFFFFF, py_perm)
                    lo, hi = (pairs[0], pairs[2]) if sub == 0 else (pairs[1], pairs[3])
                    b_frag[lane] = torch.tensor([_bf16_value(lo), _bf16_value(lo >> 16), _bf16_value(hi),
                                                 _bf16_value(hi >> 16)])
                    for j in range(4):
                        a_frag[lane, j] = a_val[plans.mfma_ab_row(lane), plans.moe_k_index(lane, g, step, j, "step", 4)]
                tmp += torch.einsum("qit,qjt->ij", a_frag.view(4, 16, 4), b_frag.view(4, 16, 4))
            col_scale = torch.tensor([2.0 ** (int(w_scales[0, 0, g, c, d]) - 127) for c in range(16)],
                                     dtype=torch.float64)
            acc += tmp * col_scale[None, :]  # one scale per C column (the lane's weight row) and block
    assert torch.allclose(acc, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


def test_prepared_flydsl_weights_are_single_copy_and_run_on_the_reference() -> None:
    from rocm_k3.flydsl_kernels.moe import prepare_weights, w2_split_k
    from rocm_k3.ops.moe import fused_moe

    weights = _expert_weights()
    prepared = prepare_weights(weights, "gfx942")
    assert not prepared.has_checkpoint_tensors and prepared.w13 is None
    x = torch.randn(5, weights.hidden, generator=seeded(15))
    ids = torch.stack([torch.randperm(weights.num_experts, generator=seeded(16 + t))[:2] for t in range(5)]).int()
    tw = torch.rand(5, 2, generator=seeded(17))
    assert torch.equal(fused_moe(x, prepared, tw, ids, backend="reference"),
                       fused_moe(x, weights, tw, ids, backend="reference"))
    assert w2_split_k(16, 3584, 3072, 304) == 4  # K3 decode T = 1: 16 blocks x 28 tiles on an MI300X
    assert w2_split_k(16, 3584, 384, 304) == 1  # TP-8 shard: N / 128 = 3 groups, no even split
    assert w2_split_k(400, 3584, 3072, 304) == 1


# --- chunked kda_prefill: index maps and a host emulation of its three phases ----------------------------


@pytest.mark.parametrize("kpl", [1, 4], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K", plans.KDA_HEAD_DIMS)
def test_kda_chunk_intra_maps_cover_tiles_once(K: int, kpl: int) -> None:
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    # the pair sums' MFMA steps take every key channel once across the 4 lane groups, kpl consecutive per lane
    dims = collections.Counter(kp.intra_pair_dim(s, q, j, kpl) for s in range(K // (4 * kpl)) for q in range(4)
                               for j in range(kpl))
    assert set(dims) == set(range(K)) and set(dims.values()) == {1}
    # the 4 waves' C fragments over tiles (I = wave, J <= I) cover the lower block triangle of the 64 x 64 pairs
    # once; every pair on or below the diagonal lies in one of them
    blocks = kp.CHUNK // kp.SUB
    pairs = collections.Counter((16 * w + r, 16 * J + c) for w in range(blocks) for J in range(w + 1)
                                for lane in range(64) for r, c in [plans.mfma_c_coord(lane, i) for i in range(4)])
    assert set(pairs.values()) == {1}
    assert {(i, j) for i in range(kp.CHUNK) for j in range(i + 1)} <= set(pairs)
    # the inverses: lanes 0 .. 63 take each (diagonal block, column) once
    inv = collections.Counter(kp.intra_inverse(t) for t in range(kp.CHUNK))
    assert set(inv) == {(blk, c) for blk in range(blocks) for c in range(kp.SUB)}
    assert set(inv.values()) == {1}


@pytest.mark.parametrize("kpl", [1, 4], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K", plans.KDA_HEAD_DIMS)
def test_kda_chunk_state_mfma_steps_cover_rows_once_and_match_c_layout(K: int, kpl: int) -> None:
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    # the K / (4 kpl) steps of a contraction over K rows take every row exactly once across the 4 lane groups
    rows = collections.Counter(kp.mfma_krow(s, q, j, kpl) for s in range(K // (4 * kpl)) for q in range(4)
                               for j in range(kpl))
    assert set(rows) == set(range(K)) and set(rows.values()) == {1}
    # the state tiles' C fragments (the MoE kernels' 16x16 C layout) are the B operands of those steps: C element i
    # of tile m is element j = e % kpl of step e // kpl, e = 4 m + i
    for lane, m, i in itertools.product(range(64), range(K // 16), range(4)):
        r, c = plans.mfma_c_coord(lane, i)
        e = 4 * m + i
        assert (16 * m + r, c) == (kp.mfma_krow(e // kpl, lane // 16, e % kpl, kpl), lane % 16)
    # and a step's kpl rows are consecutive at bf16 (one 8-byte load of a row-major operand)
    for s, q in itertools.product(range(K // (4 * kpl)), range(4)):
        first = kp.mfma_krow(s, q, 0, kpl)
        assert [kp.mfma_krow(s, q, j, kpl) for j in range(kpl)] == list(range(first, first + kpl))


def test_kda_walk_operands_follow_the_activation_dtype() -> None:
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    assert [kp.walk_operands(d) for d in ("bf16", "f16", "f32")] == ["bf16", "f32", "f32"]
    assert [kp.state_kpl(d) for d in ("bf16", "f16", "f32")] == [4, 1, 1]


def test_kda_chunk_plan_and_inter_map() -> None:
    from rocm_k3.flydsl_kernels import kda_prefill_plan as kp

    bounds = [0, 5, 69, 69, 199]  # lengths 5, 64, 0, 130
    seq, start, first = kp.chunk_plan(bounds)
    assert (seq, start, first) == ([0, 1, 3, 3, 3], [0, 5, 69, 133, 197], [0, 1, 2, 2, 5])
    pos = [(1, 64), (3, 128), (0, 5), (3, 130), (1, 64)]
    assert kp.off_grid_positions(bounds, pos) == []
    assert kp.off_grid_positions(bounds, [(3, 7), (0, 5)]) == [(3, 7)]
    imap, source = kp.inter_map(first, pos, len(seq))
    assert imap == [2, 0, -1, 1, 3] and source == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("save,path", [(None, "chunked"), ([(0, 64), (1, 70), (0, 130)], "chunked"),
                                       ([(0, 64), (1, 7)], "recurrent")], ids=["nosave", "grid", "offgrid"])
def test_kda_prefill_supports_names_the_kernel_path(save, path: str) -> None:
    from rocm_k3.flydsl_kernels import ops_impl

    T, H, K = 200, 2, 128
    q = torch.zeros(T, H, K, dtype=torch.bfloat16)
    cu = torch.tensor([0, 130, 200], dtype=torch.int32)
    pos = None if save is None else torch.tensor(save, dtype=torch.int32)
    ok, why = ops_impl.kda_prefill_supports(q, q, q, q.float(), torch.zeros(T, H), cu, torch.zeros(3, H, K, K),
                                            torch.arange(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool),
                                            intermediate_positions=pos)
    assert ok and path in why, why


# --- expanded-heads MLA prefill (mla_prefill_plan) ------------------------------------------------------------


def _mfma(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One 16x16 MFMA step from per-lane fragments a, b [64, kpl]: lane l = 16 g + r supplies A[r, (g, j)] and
    B[(g, j), r]; C[r, c] = sum_{g, j} A[r, (g, j)] B[(g, j), c]."""
    kpl = a.shape[1]
    return torch.einsum("grj,gcj->rc", a.view(4, 16, kpl), b.view(4, 16, kpl))


@pytest.mark.parametrize("kpl", [4, 8], ids=["gfx942", "gfx950"])
def test_mla_prefill_lane_maps_reproduce_causal_attention(kpl: int) -> None:
    """The expanded MLA prefill's schedule, emulated lane by lane with its index maps (one wave: 16 queries of one
    head, the segment's keys in blocks, transposed S^T and O^T MFMA tiles, the scores' C fragments reused as the PV
    B fragments, the online softmax reduced over the 4 lane groups of a column) equals causal softmax attention
    (fp32: 1e-5), with the block's last rows past the chunk and a segment that ends inside a block."""
    from rocm_k3.flydsl_kernels import mla_prefill_plan as mp

    gen = seeded(21)
    dn, pe_w, dv, keys, q_pos0, n_q = 2 * 4 * kpl, 4 * kpl, 32, 45, 30, 13  # queries at positions 30..42
    q = torch.randn(n_q, dn + pe_w, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, dn + pe_w, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, dv, generator=gen, dtype=torch.float64)
    scale = 0.3
    bn = mp.block_keys(kpl)
    lanes = range(mp.WAVE)
    col = [lane % 16 for lane in lanes]
    rows = [min(c, n_q - 1) for c in col]
    limit = [min(keys, q_pos0 + c + 1) for c in col]  # key0 = 0, the segment holds every key
    m = torch.full((64,), -3.0e38, dtype=torch.float64)
    lsum = torch.zeros(64, dtype=torch.float64)
    acc = torch.zeros(dv // 16, 64, 4, dtype=torch.float64)  # [value tile, lane, C element]
    hi = min(keys, q_pos0 + n_q)
    steps = (dn + pe_w) // (4 * kpl)
    for n0 in range(0, hi, bn):
        scores = torch.empty(64, bn // 16 * 4, dtype=torch.float64)
        for t in range(bn // 16):
            c = torch.zeros(16, 16, dtype=torch.float64)
            for s in range(steps):
                a = torch.stack([k[min(n0 + mp.qk_a_key(ln, t), keys - 1), [mp.qk_dim(ln, s, j, kpl)
                                                                            for j in range(kpl)]] for ln in lanes])
                b = torch.stack([q[rows[ln], [mp.qk_dim(ln, s, j, kpl) for j in range(kpl)]] for ln in lanes])
                c += _mfma(a, b)
            for ln in lanes:
                for i in range(4):
                    row, cc = plans.mfma_c_coord(ln, i)
                    assert mp.s_key(ln, t, i) == t * 16 + row and cc == col[ln]
                    scores[ln, 4 * t + i] = c[row, cc] * scale
        keys_of = torch.tensor([[n0 + mp.pv_key(ln, j) for j in range(kpl)] for ln in lanes])
        visible = keys_of < torch.tensor(limit)[:, None]
        bmax = torch.where(visible, scores, torch.tensor(-3.0e38, dtype=torch.float64)).amax(1)
        bmax = bmax.view(4, 16).amax(0).repeat(4)  # xor 16, 32 over the lane groups
        m_new = torch.maximum(m, bmax)
        alpha = torch.exp(m - m_new)
        p = torch.where(visible, torch.exp(scores - m_new[:, None]), torch.zeros((), dtype=torch.float64))
        lsum = lsum * alpha + p.sum(1).view(4, 16).sum(0).repeat(4)
        m = m_new
        for vt in range(dv // 16):
            a = torch.stack([v[[min(n0 + mp.pv_key(ln, j), keys - 1) for j in range(kpl)], vt * 16 + col[ln]]
                             for ln in lanes])
            c = _mfma(a, p)  # B = the lane's own probabilities
            acc[vt] = acc[vt] * alpha[:, None] + torch.stack([c[plans.mfma_c_coord(ln, i)] for ln in lanes
                                                              for i in range(4)]).view(64, 4)
    out = torch.full((n_q, dv), float("nan"), dtype=torch.float64)
    for ln in lanes:
        if col[ln] < n_q:
            for vt in range(dv // 16):
                for i in range(4):
                    out[col[ln], mp.out_col(ln, vt, i)] = acc[vt, ln, i] / lsum[ln]
    s_ref = (q @ k.T) * scale  # [n_q, keys]
    future = torch.arange(keys)[None, :] > (q_pos0 + torch.arange(n_q))[:, None]
    want = torch.softmax(s_ref.masked_fill(future, float("-inf")), dim=1) @ v
    assert torch.isfinite(out).all()
    assert (out - want).norm() / want.norm() < 1e-5


def test_mla_prefill_plan_covers_tiles_once() -> None:
    from rocm_k3.flydsl_kernels import mla_prefill_plan as mp

    for kpl in (4, 8):
        bn = mp.block_keys(kpl)
        keys = collections.Counter(mp.pv_key(ln, j) for ln in range(0, 64, 16) for j in range(kpl))  # one lane a group
        assert sorted(keys) == list(range(bn)) and all(n == 1 for n in keys.values())
        dims = collections.Counter(mp.qk_dim(ln, s, j, kpl) for ln in range(0, 64, 16) for s in range(3)
                                   for j in range(kpl))
        assert sorted(dims) == list(range(3 * 4 * kpl)) and all(n == 1 for n in dims.values())
        cols = collections.Counter((ln % 16, mp.out_col(ln, vt, i)) for ln in range(64) for vt in range(2)
                                   for i in range(4))
        assert len(cols) == 16 * 32 and all(n == 1 for n in cols.values())


def test_mla_prefill_supports_and_config_explain_refusals() -> None:
    """The FlyDSL MLA prefill serves only calls whose every chunk takes the expanded kernel, in bf16/fp16 on
    gfx942/gfx950, at geometries its MFMA depth tiles; each refusal names the reason."""
    pytest.importorskip("flydsl")
    from rocm_k3.flydsl_kernels.mla_ops import mla_prefill_supports
    from rocm_k3.flydsl_kernels.mla_prefill import MlaPrefillConfig
    from rocm_k3.ops.mla import EXPANDED_MIN_QUERIES

    def call(counts: list[int], dtype: torch.dtype = torch.bfloat16):
        cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
        q = torch.zeros(int(cu[-1]), 2, 192, dtype=dtype)
        return mla_prefill_supports(q, torch.zeros(4, 64, 576, dtype=dtype), torch.zeros(len(counts), 4,
                                    dtype=torch.int32), cu, torch.tensor(counts, dtype=torch.int32),
                                    torch.zeros(2 * 256, 512, dtype=dtype))

    ok, why = call([EXPANDED_MIN_QUERIES - 1, 200])
    assert not ok and "absorbed kernel" in why and str(EXPANDED_MIN_QUERIES - 1) in why
    ok, why = call([200], torch.float32)
    assert not ok and "bf16/fp16" in why
    ok, why = call([200, 0])  # long enough, but this host has no AMD GPU
    assert not ok and "arch must be one of" in why
    assert MlaPrefillConfig("gfx950", 12).block_n == 32 and MlaPrefillConfig("gfx942", 12).block_n == 16
    for bad, match in [(dict(arch="sm_90"), "arch"), (dict(dtype="f32"), "bf16 or f16"), (dict(rope=24), "rope=24"),
                       (dict(arch="gfx950", nope=48), "nope=48"), (dict(v_dim=40), "v_dim=40"),
                       (dict(gate_dtype="f8"), "unsupported dtype")]:
        with pytest.raises(ValueError, match=match):
            MlaPrefillConfig(**{"arch": "gfx942", "num_heads": 12, **bad})
