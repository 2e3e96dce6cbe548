"""E8M0 block scales: the byte codec and the two rules that choose a block's exponent.

An E8M0 byte ``s`` means ``2^(s - 127)``; ``0xFF`` is NaN. A block of 32 elements with largest magnitude
``amax`` gets the exponent ``e = floor(log2(amax')) - emax`` where ``emax`` is the exponent of the element
format's largest power of two (E2M1: 2, FP8 e4m3fn: 8, FP8 e4m3fnuz: 7) and

- rule ``"ocp"`` (strict OCP MX v1.0): ``amax' = amax``;
- rule ``"ct"`` (compressed-tensors / vLLM, the K3 checkpoint's rule): ``amax' = amax`` rounded up to the next
  power of two when its mantissa is >= 1.75 (``amax = m * 2^f`` with ``1.75 <= m < 2`` gives ``f + 1``).
  Example: E2M1 with amax 7.0 = 1.75 * 2^2 gives ``e = 3 - 2 = +1``, not 0.

An all-zero block gets byte 0; exponents are clamped to the representable range [-127, 127] (bytes 0..254).
"""

from __future__ import annotations

import torch

SCALE_RULES = ("ct", "ocp")
E8M0_BIAS = 127
E8M0_NAN = 0xFF
_MIN_EXP, _MAX_EXP = -E8M0_BIAS, 254 - E8M0_BIAS
_CT_MANTISSA = 0.875  # frexp mantissa in [0.5, 1): 0.875 * 2 = 1.75


def check_rule(rule: object) -> str:
    """Validate a scale rule name (ValueError naming the choices)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"rule must be one of {SCALE_RULES}, got {rule!r}")
    return rule  # type: ignore[return-value]


def scale_exponent(amax: torch.Tensor, emax: int, rule: str) -> torch.Tensor:
    """Unbiased block exponent for each block maximum.

    amax: fp32 [...] block maxima of |x| (finite, >= 0). emax: the element format's top exponent.
    Returns int32 [...] in [-127, 127]; an all-zero block (amax == 0) gets -127 (byte 0).
    """
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1) (0 for 0)
    floor_log2 = exponent - 1  # [...] int32, exact for normal and subnormal fp32
    if rule == "ct":
        floor_log2 = floor_log2 + (mantissa >= _CT_MANTISSA).to(floor_log2.dtype)
    exp = (floor_log2 - emax).clamp(_MIN_EXP, _MAX_EXP)
    return torch.where(amax == 0, torch.full_like(exp, _MIN_EXP), exp).to(torch.int32)


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """int32 [...] exponents in [-127, 127] -> uint8 [...] scale bytes."""
    return (exponent + E8M0_BIAS).to(torch.uint8)


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [...] scale bytes -> fp32 [...] exactly ``2^(s - 127)`` (byte 0 is the subnormal 2^-127; 0xFF is NaN)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)  # fp32 bit patterns of 2^(s-127)
    values = bits.view(torch.float32)
    return torch.where(s == E8M0_NAN, torch.full_like(values, float("nan")), values)


def check_no_nan_scale(scales: torch.Tensor, name: str = "scales") -> None:
    """Raise ValueError if any scale byte is 0xFF (the E8M0 NaN)."""
    if bool((scales == E8M0_NAN).any()):
        count = int((scales == E8M0_NAN).sum())
        raise ValueError(
            f"{name} holds {count} NaN scale (0xFF) byte(s); an MX block with a NaN scale cannot be dequantised"
        )
