"""FP4 E2M1 element codec: the 16 codes, round-to-nearest-even encoding and nibble packing.

Code layout (OCP MX v1.0): bit 3 = sign, bits 2..0 index the magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
Encoding rounds ``|v|`` to the nearest grid value with ties to the even code (3.5 -> 4, 2.5 -> 2, 0.25 -> 0),
saturates at 6, and keeps the sign bit of every negative input, including values that round to zero and
``-0.0`` (code 8), as the compressed-tensors checkpoint tools do. Packing puts two codes in a byte with the
**low nibble = the even (first) element**.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest power of two on the grid (4 = 2^2); MX scale offset
SIGN_BIT = 8

# magnitude of codes 0..7; codes 8..15 are the same values negated.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between neighbouring magnitudes and how a tie there is broken: ``True`` when the upper code is
# the even one (the tie rounds up), ``False`` when the lower code is even (the tie rounds down).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_values(device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [16]: the value of each code (code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their block scale) to E2M1 codes.

    v: fp32 [...] (finite). Returns uint8 [...] codes in 0..15 (one per element, unpacked).
    """
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for midpoint, tie_up in _MIDPOINTS:
        passed = mag >= midpoint if tie_up else mag > midpoint
        code += passed.to(torch.uint8)  # at most 7: values above 5 saturate to code 7 (= 6.0)
    code |= torch.signbit(v).to(torch.uint8) << 3
    return code


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [...] codes 0..15 -> fp32 [...] values."""
    return e2m1_values(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes (K even) -> uint8 [..., K/2]; element 2i in the low nibble, 2i+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] codes, the inverse of :func:`pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)  # [..., K/2, 2] -> [..., K]
