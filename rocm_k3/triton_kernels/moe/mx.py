"""Bit-exact MX helpers used inside the MoE kernels (``@triton.jit`` device functions, integer arithmetic only).

They reproduce :mod:`rocm_k3.quant` exactly, without FP8 hardware types, so the same code runs under the
interpreter, on NVIDIA, on gfx942 (FNUZ) and on gfx950 (OCP):

- ``mx_scale_exponent(amax, EMAX)``: the compressed-tensors ("ct") rule, ``floor(log2(amax)) (+1 when the
  mantissa >= 1.75) - EMAX`` clamped to [-127, 127]; amax = 0 gives -127 (byte 0).
- ``pow2(e)``: exactly ``2^e`` in fp32 for integer e in [-127, 127] (2^-127 is the subnormal 0x00400000).
- ``fp8_e4m3_encode(v, BIAS)``: |v| <= the format max, round-to-nearest-even to E4M3 with exponent bias BIAS
  (7: OCP e4m3fn, 8: FNUZ e4m3fnuz); returns the code byte as int32. FNUZ never emits 0x80 (its NaN).
- ``fp8_e4m3_decode(code, BIAS)``: code byte (int32) -> fp32 value.
- ``mxfp8_value(v, amax, EMAX, BIAS, FP8_MAX)``: elementwise, the MXFP8 value of ``v`` in a block whose maximum
  magnitude is ``amax`` (broadcast to v's shape): quantised with the block's scale and decoded back, exact.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """fp32 2^e for int32 e in [-127, 127], exact."""
    bits = tl.where(e > -127, (e + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mx_scale_exponent(amax, EMAX: tl.constexpr):
    """int32 block exponent for fp32 block maxima ``amax >= 0`` (ct rule)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) >= 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e - EMAX, -127), 127)
    return tl.where(amax == 0.0, -127, e)


@triton.jit
def _round_mantissa3(a):
    """fp32 magnitude bits -> bits rounded to 3 mantissa bits, round-to-nearest-even."""
    r = a + 0x7FFFF + ((a >> 20) & 1)
    return r & -1048576  # clear the low 20 bits


@triton.jit
def fp8_e4m3_encode(v, BIAS: tl.constexpr):
    """E4M3 code (int32 0..255) of fp32 ``v`` already clamped to the format's finite range."""
    bits = v.to(tl.int32, bitcast=True)
    neg = bits < 0
    a = bits & 0x7FFFFFFF  # |v| bits
    min_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    code_n = (_round_mantissa3(a) >> 20) - ((127 - BIAS) << 3)
    # subnormal range: |v| + min_normal lies in [min_normal, 2 min_normal), where 3 mantissa bits = the E4M3 quantum
    shifted = (a.to(tl.float32, bitcast=True) + min_normal).to(tl.int32, bitcast=True)
    code_s = (_round_mantissa3(shifted) >> 20) - ((128 - BIAS) << 3)
    code = tl.where(a.to(tl.float32, bitcast=True) < min_normal, code_s, code_n)
    if BIAS == 8:  # FNUZ: no negative zero
        return tl.where(neg & (code != 0), code | 0x80, code)
    return tl.where(neg, code | 0x80, code)


@triton.jit
def fp8_e4m3_decode(code, BIAS: tl.constexpr):
    """fp32 value of E4M3 code bytes (int32)."""
    e = (code >> 3) & 0xF
    m = code & 7
    normal = (((e + 127 - BIAS) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * (2.0 ** (-2 - BIAS))
    val = tl.where(e == 0, sub, normal)
    return tl.where((code & 0x80) != 0, -val, val)


@triton.jit
def mxfp8_value(v, amax, EMAX: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp32 ``v`` -> its MXFP8 value (E4M3 with bias BIAS, E8M0 scale from the block maximum ``amax``), fp32."""
    e = mx_scale_exponent(amax, EMAX)
    scaled = tl.minimum(tl.maximum(v * pow2(-e), -FP8_MAX), FP8_MAX)
    return fp8_e4m3_decode(fp8_e4m3_encode(scaled, BIAS), BIAS) * pow2(e)
