"""Bit-level number-format formulas of the MoE kernels, in plain Python usable on DSL values too.

The kernels call these functions while tracing, with FlyDSL Int32 values and ``select = dsl_select``; the
host tests call them with Python ints and ``select = py_select`` and compare with torch's own fp8/bf16/fp32
decoding and with ``rocm_k3.quant``. Only ``& | << >> + - * < == >=`` and ``select`` are used, so one
definition serves both. Nothing here imports FlyDSL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Select = Callable[[Any, Any, Any], Any]

BF16_HALF = 0x3F00  # bf16 bit pattern of 0.5
CT_MANTISSA_BITS = 0x600000  # fp32 mantissa field of 1.75 (compressed-tensors rounds amax up from here)


def py_select(cond: Any, a: Any, b: Any) -> Any:
    return a if cond else b


def dsl_select(cond: Any, a: Any, b: Any) -> Any:
    return cond.select(a, b)


def e2m1_to_bf16_bits(nib, select: Select):
    """E2M1 code (0..15, bit 3 = sign) -> bf16 bit pattern of its value (exact): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    mag = nib & 7
    bits = select(mag < 2, mag * BF16_HALF, (mag << 6) + BF16_HALF)
    return bits | ((nib & 8) << 12)


def e2m1_to_e4m3_byte(nib, fnuz: bool, select: Select):
    """E2M1 code -> the e4m3 byte of the same value (exact). FNUZ (bias 8) has no -0: a signed zero gives 0."""
    half = 0x38 if fnuz else 0x30  # e4m3 byte of 0.5
    mag = nib & 7
    byte = select(mag < 2, mag * half, (mag << 2) + half)
    sign = select(mag == 0, nib * 0, (nib & 8) << 4)
    return byte | sign


def e8m0_to_f32_bits(byte, select: Select):
    """E8M0 scale byte (not 0xFF) -> fp32 bit pattern of 2^(byte - 127); byte 0 is the subnormal 2^-127."""
    return select(byte == 0, byte * 0 + 0x00400000, byte << 23)


def mx_scale_exponent(amax_bits, emax: int, select: Select):
    """Unbiased MX block exponent from the fp32 bits of a block's amax (>= 0), compressed-tensors rule:
    floor(log2(amax)) + (mantissa >= 1.75) - emax, clamped to [-127, 127]; amax == 0 (or subnormal) -> -127."""
    floor_log2 = ((amax_bits >> 23) & 255) - 127
    floor_log2 = floor_log2 + select((amax_bits & 0x7FFFFF) >= CT_MANTISSA_BITS, 1, 0)
    e = floor_log2 - emax
    e = select(e > 127, e * 0 + 127, e)
    e = select(e < -127, e * 0 - 127, e)
    return select(amax_bits == 0, e * 0 - 127, e)


def pow2_neg_f32_bits(e):
    """fp32 bits of 2^-e for a block exponent e in [-127, 119] (the range a finite fp32 amax can give)."""
    return (127 - e) << 23
