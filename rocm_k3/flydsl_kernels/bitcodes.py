"""Bit-level number-format formulas of the MoE kernels, in plain Python usable on DSL values too.

The kernels call these functions while tracing, with FlyDSL Int32 values and ``select = dsl_select`` (and
``perm`` = ``v_perm_b32``); the host tests call them with Python ints, ``select = py_select`` and ``perm =
py_perm`` and compare with torch's own fp8/bf16/fp32 decoding and with ``rocm_k3.quant``. Only
``& | << >> + - * < == >=``, ``select`` and ``perm`` are used, so one definition serves both. Nothing here imports
FlyDSL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Select = Callable[[Any, Any, Any], Any]
Perm = Callable[[Any, Any, Any], Any]

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


def e8m0_to_f32_bits_by_max(byte, maximum):
    """The same bits as :func:`e8m0_to_f32_bits` with one max instead of a compare and select: ``byte << 23`` is
    the fp32 2^(byte - 127) for byte >= 1 and is 0 for byte 0, whose value 2^-127 (0x00400000) is the larger."""
    return maximum(byte << 23, 0x00400000)


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


# v_perm_b32 byte pools (two dwords each: entries 0..3, then 4..7) of |E2M1| in bf16, indexed by the 3 magnitude
# bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 are bf16 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0 (exact).
# (as signed 32-bit values, the form a DSL i32 constant takes; py_perm reads only their low 32 bits)
E2M1_BF16_HI = (0x3F3F3F00, 0x40404040)  # high bytes
E2M1_BF16_LO = (0xC0800000 - (1 << 32), 0xC0804000 - (1 << 32))  # low bytes
_SIGN_BYTES = 0x80808080 - (1 << 32)  # bit 7 of every byte
_PAIR_SEL = (0x05010400, 0x07030602)  # bytes (lo.b0, hi.b0, lo.b1, hi.b1) / (lo.b2, hi.b2, lo.b3, hi.b3)


def py_perm(src_hi, src_lo, sel):
    """``v_perm_b32(src_hi, src_lo, sel)`` for selector bytes 0..7 (a byte of the pool ``src_hi:src_lo``,
    ``src_lo`` being bytes 0..3) and 0x0C (zero), the ones the decode uses."""
    pool = ((src_hi & 0xFFFFFFFF) << 32) | (src_lo & 0xFFFFFFFF)
    out = 0
    for i in range(4):
        b = (sel >> (8 * i)) & 0xFF
        if b > 7 and b != 0x0C:
            raise ValueError(f"selector byte {b:#x} is outside what the decode uses")
        out |= 0 if b == 0x0C else ((pool >> (8 * b)) & 0xFF) << (8 * i)
    return out


def e2m1x8_to_bf16_pairs(word, perm: Perm):
    """8 E2M1 codes of a dword (nibble p = bits 4p..4p+3) -> 4 dwords of unscaled bf16 pairs (exact):
    (v(n0), v(n2)), (v(n4), v(n6)), (v(n1), v(n3)), (v(n5), v(n7)), low half first.

    The byte-lookup decode of gfx942 (no FP4 hardware): the magnitude bits of the even / odd nibbles select the
    high and low bf16 bytes from the two pools (4 ``v_perm_b32``), the sign bits are OR-ed into the high bytes,
    and 4 more perms interleave low and high bytes into bf16 pairs: 14 VALU per 8 weights.
    """
    sel_even = word & 0x07070707
    sel_odd = (word >> 4) & 0x07070707
    lo_even = perm(E2M1_BF16_LO[1], E2M1_BF16_LO[0], sel_even)
    hi_even = perm(E2M1_BF16_HI[1], E2M1_BF16_HI[0], sel_even) | ((word << 4) & _SIGN_BYTES)
    lo_odd = perm(E2M1_BF16_LO[1], E2M1_BF16_LO[0], sel_odd)
    hi_odd = perm(E2M1_BF16_HI[1], E2M1_BF16_HI[0], sel_odd) | (word & _SIGN_BYTES)
    return (perm(hi_even, lo_even, _PAIR_SEL[0]), perm(hi_even, lo_even, _PAIR_SEL[1]),
            perm(hi_odd, lo_odd, _PAIR_SEL[0]), perm(hi_odd, lo_odd, _PAIR_SEL[1]))


# e4m3fnuz bytes of |E2M1| (0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x00 38 40 44 48 4C 50 54), one v_perm_b32 pool
E2M1_FNUZ = (0x44403800, 0x54504C48)
_LOW7_BYTES = 0x7F7F7F7F


def e2m1x8_to_fnuz_words(word, perm: Perm):
    """8 E2M1 codes of a dword -> 2 dwords of e4m3fnuz bytes (exact): codes (n0, n2, n4, n6), then (n1, n3, n5, n7).

    One perm per 4 codes looks the magnitudes up; the sign goes to bit 7 only of non-zero bytes (FNUZ has no -0:
    0x80 is its NaN; ``byte + 0x7F`` has bit 7 set exactly for a non-zero magnitude byte): 12 VALU per 8 weights.
    """
    mag_even = perm(E2M1_FNUZ[1], E2M1_FNUZ[0], word & 0x07070707)
    mag_odd = perm(E2M1_FNUZ[1], E2M1_FNUZ[0], (word >> 4) & 0x07070707)
    even = (((mag_even + _LOW7_BYTES) & (word << 4)) & _SIGN_BYTES) | mag_even
    odd = (((mag_odd + _LOW7_BYTES) & word) & _SIGN_BYTES) | mag_odd
    return even, odd
