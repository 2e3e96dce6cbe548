"""MXFP4 / MXFP8 quantisers against hand-written codes and an independent bit-level oracle (K3_SPEC section 6)."""

from __future__ import annotations

import math

import pytest
import torch

from rocm_k3.ops import quant
from rocm_k3.quant import blocks

ONE_BLOCK = 32
FP8_DTYPES = [pytest.param(torch.float8_e4m3fn, id="ocp"), pytest.param(torch.float8_e4m3fnuz, id="fnuz")]


def block(*values: float, fill: float = 0.0) -> torch.Tensor:
    """fp32 [1, 32]: the given values followed by ``fill``."""
    return torch.tensor([list(values) + [fill] * (ONE_BLOCK - len(values))], dtype=torch.float32)


def oracle_e2m1(code: int) -> float:
    """E2M1 from its bit fields: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); exp 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2)
    return sign * mag


def oracle_dequant_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp64 [..., K] from bit fields and ``2 ** (s - 127)``, written without the package's tables."""
    table = torch.tensor([oracle_e2m1(c) for c in range(16)], dtype=torch.float64)
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)  # [..., K]
    scale = torch.pow(2.0, scales.double() - 127.0).repeat_interleave(ONE_BLOCK, dim=-1)
    return table[codes] * scale


def oracle_exponent(amax: float, emax: int, rule: str) -> int:
    """Scale exponent by python math: floor(log2 amax) (+1 under "ct" when the mantissa >= 1.75) - emax."""
    if amax == 0.0:
        return -127
    floor_log2 = math.floor(math.log2(amax))
    if rule == "ct" and amax / 2.0**floor_log2 >= 1.75:
        floor_log2 += 1
    return max(-127, min(127, floor_log2 - emax))


# ---------------------------------------------------------------- MXFP4 codes, packing and rounding


def test_mxfp4_every_code_value_and_nibble_order():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = block(*grid, *[-v for v in grid])  # codes 0..15 in order, amax 6 -> scale 2^0
    packed, scales = quant.quantize_mxfp4(x)
    assert scales.tolist() == [[127]]
    # two codes per byte, low nibble = even element: (0,1) -> 0x10, (2,3) -> 0x32, ... (14,15) -> 0xFE
    assert packed[0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert packed[0, 8:].tolist() == [0] * 8
    out = quant.dequantize_mxfp4(packed, scales)
    assert out[0, :16].tolist() == grid + [-v for v in grid]
    assert torch.signbit(out[0, 8]), "code 8 dequantises to -0.0"


def test_mxfp4_nibble_order_single_byte():
    packed, scales = quant.quantize_mxfp4(block(1.0, 6.0))  # element 0 -> code 2 (low), element 1 -> code 7 (high)
    assert packed[0, 0].item() == 0x72
    hand = torch.zeros(1, 16, dtype=torch.uint8)
    hand[0, 0] = 0x27  # low nibble 7 (6.0) is element 0, high nibble 2 (1.0) is element 1
    assert quant.dequantize_mxfp4(hand, torch.tensor([[127]], dtype=torch.uint8))[0, :2].tolist() == [6.0, 1.0]


@pytest.mark.parametrize(
    "value, expected",
    [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (0.2, 0.0),
        (0.3, 0.5),
        (2.6, 3.0),
        (5.1, 6.0),
        (-3.5, -4.0),
        (-2.5, -2.0),
    ],
    ids=lambda v: f"{v}",
)
def test_mxfp4_round_to_nearest_even(value, expected):
    packed, scales = quant.quantize_mxfp4(block(6.0, value))  # amax 6 keeps the scale at 2^0
    assert scales.item() == 127
    assert quant.dequantize_mxfp4(packed, scales)[0, 1].item() == expected


@pytest.mark.parametrize("rule, amax", [("ct", 6.9), ("ocp", 7.9)])
def test_mxfp4_saturates_at_six(rule, amax):
    packed, scales = quant.quantize_mxfp4(block(amax, -amax, 6.5), rule)
    assert scales.item() == 127  # both amax values keep exponent 0 under their rule
    assert quant.dequantize_mxfp4(packed, scales)[0, :3].tolist() == [6.0, -6.0, 6.0]


def test_mxfp4_negative_rounding_to_zero_keeps_sign_code():
    packed, scales = quant.quantize_mxfp4(block(6.0, -0.1, 0.1, -0.0))
    codes = [packed[0, 0].item() >> 4, packed[0, 1].item() & 0xF, packed[0, 1].item() >> 4]
    assert codes == [8, 0, 8]  # -0.1 -> code 8, +0.1 -> code 0, -0.0 -> code 8


def test_mxfp4_zero_block_gets_scale_byte_zero():
    x = torch.zeros(2, 64)
    x[1, 32:] = -0.0
    x[1, :32] = torch.linspace(-1, 1, 32)
    packed, scales = quant.quantize_mxfp4(x)
    assert scales[0].tolist() == [0, 0]
    assert scales[1, 1].item() == 0
    assert packed[0].tolist() == [0] * 32
    assert packed[1, 16:].tolist() == [0x88] * 16  # negative zeros keep code 8


# ---------------------------------------------------------------- scale rules


@pytest.mark.parametrize(
    "amax, ct_byte, ocp_byte",
    [
        (7.0, 128, 127),  # 1.75 * 2^2: ct rounds to 2^3 -> exponent +1; strict OCP keeps 0
        (float(torch.tensor(7.0).nextafter(torch.tensor(0.0))), 127, 127),  # mantissa just below 1.75
        (6.0, 127, 127),
        (4.0, 127, 127),
        (3.9, 127, 126),  # 1.95 * 2^1
        (1.0, 125, 125),
        (0.875, 125, 124),  # 1.75 * 2^-1
        (2.0**-130, 0, 0),  # below the E8M0 range: clamped to byte 0
    ],
    ids=["7.0", "7.0-ulp", "6.0", "4.0", "3.9", "1.0", "0.875", "tiny"],
)
def test_mxfp4_scale_rules(amax, ct_byte, ocp_byte):
    x = block(amax, -amax / 3)
    assert quant.quantize_mxfp4(x, "ct")[1].item() == ct_byte
    assert quant.quantize_mxfp4(x, "ocp")[1].item() == ocp_byte


@pytest.mark.parametrize("rule", ["ct", "ocp"])
def test_mxfp4_scales_match_python_math(rule):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 256, generator=gen) * torch.pow(2.0, torch.randint(-40, 40, (16, 1), generator=gen).float())
    _, scales = quant.quantize_mxfp4(x, rule)
    amax = x.reshape(16, 8, 32).abs().amax(-1)
    expected = [[oracle_exponent(a, 2, rule) + 127 for a in row] for row in amax.tolist()]
    assert scales.tolist() == expected


# ---------------------------------------------------------------- round trip


def mxfp4_error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-element bound: half the grid step at |x|/scale (0.25, 0.5, 1) or the saturation distance above 6."""
    scale = torch.pow(2.0, scales.double() - 127.0).repeat_interleave(ONE_BLOCK, dim=-1)
    v = x.double().abs() / scale
    half = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    return torch.maximum(half, v - 6.0) * scale


@pytest.mark.parametrize("rule", ["ct", "ocp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_round_trip_within_half_step(rule, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 128, generator=gen) * 3).to(dtype)
    packed, scales = quant.quantize_mxfp4(x, rule)
    assert packed.shape == (3, 5, 64) and scales.shape == (3, 5, 4)
    out = quant.dequantize_mxfp4(packed, scales, dtype=torch.float64)
    assert torch.equal(out, oracle_dequant_mxfp4(packed, scales))
    err = (out - x.double()).abs()
    assert bool((err <= mxfp4_error_bound(x, scales)).all())
    v = x.double().abs() / torch.pow(2.0, scales.double() - 127.0).repeat_interleave(32, -1)
    assert v.max().item() < (7.0 if rule == "ct" else 8.0)


def test_quantisers_are_row_chunked(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=gen)
    whole4, whole8 = quant.quantize_mxfp4(x), quant.quantize_mxfp8(x, torch.float8_e4m3fn)
    monkeypatch.setattr(blocks, "CHUNK_ELEMENTS", 200)  # two rows per chunk
    chunk4, chunk8 = quant.quantize_mxfp4(x), quant.quantize_mxfp8(x, torch.float8_e4m3fn)
    assert torch.equal(whole4[0], chunk4[0]) and torch.equal(whole4[1], chunk4[1])
    assert torch.equal(whole8[0].view(torch.uint8), chunk8[0].view(torch.uint8))
    assert torch.equal(quant.dequantize_mxfp4(*whole4), oracle_dequant_mxfp4(*whole4).float())


# ---------------------------------------------------------------- errors


def test_nan_scale_raises_on_dequantise():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.tensor([[127], [0xFF]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"NaN scale \(0xFF\)"):
        quant.dequantize_mxfp4(packed, scales)
    q = torch.zeros(2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"NaN scale \(0xFF\)"):
        quant.dequantize_mxfp8(q, scales)


@pytest.mark.parametrize("k", [0, 16, 48, 100])
def test_k_not_multiple_of_32_raises(k):
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_mxfp4(torch.zeros(2, k))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_mxfp8(torch.zeros(2, k), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.dequantize_mxfp4(torch.zeros(2, k // 2, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


def test_bad_arguments_raise_named_errors():
    x = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="rule"):
        quant.quantize_mxfp4(x, "floor")
    with pytest.raises(TypeError, match="x must be"):
        quant.quantize_mxfp4(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.quantize_mxfp4(block(float("inf")))
    with pytest.raises(TypeError, match="packed must be uint8"):
        quant.dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 1\)"):
        quant.dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="fp8_dtype"):
        quant.quantize_mxfp8(x, torch.bfloat16)
    with pytest.raises(TypeError, match="fp8_dtype"):
        quant.quantize_mxfp8(x, None)
    with pytest.raises(TypeError, match="q.dtype"):
        quant.dequantize_mxfp8(x, torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="dtype must be a floating"):
        quant.dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), torch.int8)


# ---------------------------------------------------------------- MXFP8: OCP vs FNUZ


def test_fp8_dtype_for_arch():
    assert quant.fp8_dtype_for_arch("gfx942") is torch.float8_e4m3fnuz
    assert quant.fp8_dtype_for_arch("gfx942:sramecc+:xnack-") is torch.float8_e4m3fnuz
    assert quant.fp8_dtype_for_arch("gfx950") is torch.float8_e4m3fn
    assert quant.fp8_dtype_for_arch("sm_90") is torch.float8_e4m3fn
    assert quant.fp8_dtype_for_arch("sm_90a") is torch.float8_e4m3fn
    for unknown in ("gfx1100", "sm_x", "cpu"):
        with pytest.raises(ValueError, match=unknown):
            quant.fp8_dtype_for_arch(unknown)


@pytest.mark.parametrize(
    "fp8_dtype, byte_for_amax_1, max_value",
    [
        pytest.param(torch.float8_e4m3fn, 127 - 8, 448.0, id="ocp"),
        pytest.param(torch.float8_e4m3fnuz, 127 - 7, 240.0, id="fnuz"),
    ],
)
def test_mxfp8_scale_offset_and_range(fp8_dtype, byte_for_amax_1, max_value):
    q, scales = quant.quantize_mxfp8(block(1.0, -0.5), fp8_dtype)
    assert scales.item() == byte_for_amax_1  # floor(log2 1) - 8 (OCP) or - 7 (FNUZ)
    assert q.float()[0, :2].tolist() == [1.0 / 2.0 ** (byte_for_amax_1 - 127), -0.5 / 2.0 ** (byte_for_amax_1 - 127)]
    # strict OCP rule: amax 1.99 scales to 509 (OCP) / 254.7 (FNUZ), beyond the format: saturates at its max
    q, scales = quant.quantize_mxfp8(block(1.99, -1.99), fp8_dtype, rule="ocp")
    assert q.float()[0, :2].tolist() == [max_value, -max_value]
    out = quant.dequantize_mxfp8(q, scales)
    assert out[0, :2].tolist() == [
        max_value * 2.0 ** (byte_for_amax_1 - 127),
        -max_value * 2.0 ** (byte_for_amax_1 - 127),
    ]


@pytest.mark.parametrize(
    "fp8_dtype, byte, q_value",
    [
        pytest.param(torch.float8_e4m3fn, 120, 224.0, id="ocp"),
        pytest.param(torch.float8_e4m3fnuz, 121, 112.0, id="fnuz"),
    ],
)
def test_mxfp8_ct_rule_rounds_amax_up(fp8_dtype, byte, q_value):
    # amax 1.8 has mantissa >= 1.75: ct uses exponent floor(log2 2) - offset = 1 - 8 (OCP) or 1 - 7 (FNUZ);
    # 1.8 * 2^7 = 230.4 -> 224 (E4M3 step 16 in [128, 256)); 1.8 * 2^6 = 115.2 -> 112 (step 8 in [64, 128))
    q, scales = quant.quantize_mxfp8(block(1.8), fp8_dtype)
    assert scales.item() == byte
    assert q.float()[0, 0].item() == q_value


def test_e4m3fnuz_has_no_negative_zero():
    x = block(1.0, -0.0, -1e-9, 0.0)
    q_fnuz, _ = quant.quantize_mxfp8(x, torch.float8_e4m3fnuz)
    assert 0x80 not in q_fnuz.view(torch.uint8).tolist()[0]  # 0x80 is NaN in FNUZ
    assert q_fnuz.view(torch.uint8)[0, 1:4].tolist() == [0, 0, 0]
    q_ocp, _ = quant.quantize_mxfp8(x, torch.float8_e4m3fn)
    assert q_ocp.view(torch.uint8)[0, 1:4].tolist() == [0x80, 0x80, 0x00]  # OCP keeps -0


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("rule", ["ct", "ocp"])
def test_mxfp8_round_trip_and_scales(fp8_dtype, rule):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=gen) * torch.pow(2.0, torch.randint(-20, 20, (6, 1), generator=gen).float())
    q, scales = quant.quantize_mxfp8(x, fp8_dtype, rule)
    assert q.dtype == fp8_dtype and scales.shape == (6, 4)
    emax = 8 if fp8_dtype == torch.float8_e4m3fn else 7
    amax = x.reshape(6, 4, 32).abs().amax(-1)
    assert scales.tolist() == [[oracle_exponent(a, emax, rule) + 127 for a in row] for row in amax.tolist()]
    scale = torch.pow(2.0, scales.double() - 127.0).repeat_interleave(32, -1)
    out = quant.dequantize_mxfp8(q, scales, torch.float64)
    assert torch.equal(out, q.double() * scale)
    v = x.double().abs() / scale
    fmax = torch.finfo(fp8_dtype).max
    sub_half = 2.0**-10 if fp8_dtype == torch.float8_e4m3fn else 2.0**-11
    bound = torch.maximum(torch.maximum(v * 2.0**-4, torch.full_like(v, sub_half)), v - fmax) * scale
    assert bool(((out - x.double()).abs() <= bound).all())


@pytest.mark.cuda
@pytest.mark.parametrize("rule", ["ct", "ocp"])
def test_reference_quantisers_on_gpu_match_cpu(rule):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=gen) * torch.pow(2.0, torch.randint(-30, 30, (64, 1), generator=gen).float())
    packed, scales = quant.quantize_mxfp4(x, rule)
    packed_gpu, scales_gpu = quant.quantize_mxfp4(x.cuda(), rule, backend="reference")
    assert torch.equal(packed_gpu.cpu(), packed) and torch.equal(scales_gpu.cpu(), scales)
    assert torch.equal(
        quant.dequantize_mxfp4(packed_gpu, scales_gpu, backend="reference").cpu(),
        oracle_dequant_mxfp4(packed, scales).float(),
    )
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        q, s = quant.quantize_mxfp8(x, fp8_dtype, rule)
        q_gpu, s_gpu = quant.quantize_mxfp8(x.cuda(), fp8_dtype, rule, backend="reference")
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_gpu.cpu(), s)
        assert torch.equal(
            quant.dequantize_mxfp8(q_gpu, s_gpu, backend="reference").cpu(), quant.dequantize_mxfp8(q, s)
        )
