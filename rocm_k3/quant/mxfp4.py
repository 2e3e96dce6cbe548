"""MXFP4 (OCP microscaling, E2M1 elements + one E8M0 scale per 32) quantise / dequantise, row-chunked.

Layout (the compressed-tensors ``mxfp4-pack-quantized`` checkpoint layout): for ``x [..., K]``,
``packed uint8 [..., K/2]`` (low nibble = even element) and ``scales uint8 [..., K/32]`` along the last dim.
Math per block of 32: ``e = scale_exponent(amax, 2, rule)`` (see :mod:`rocm_k3.quant.e8m0`),
``code_i = E2M1_rne(x_i / 2^e)`` (saturating at 6); dequantised ``x_i ~ value(code_i) * 2^e``.

The ``*_reference`` functions skip validation (the ops layer validates once, then dispatches to them);
:func:`quantize_mxfp4` and :func:`dequantize_mxfp4` validate and run the reference directly.
"""

from __future__ import annotations

import torch

from rocm_k3.quant.blocks import BLOCK_SIZE, check_float_input, check_scales, row_chunks
from rocm_k3.quant.e2m1 import E2M1_EMAX, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from rocm_k3.quant.e8m0 import check_no_nan_scale, check_rule, decode_e8m0, encode_e8m0, scale_exponent


def check_quantize_mxfp4_args(x: torch.Tensor, rule: str) -> None:
    """x: float [..., K] with K a positive multiple of 32, finite; rule in ("ct", "ocp")."""
    check_float_input(x, "x")
    check_rule(rule)


def check_dequantize_mxfp4_args(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    """packed uint8 [..., K/2], scales uint8 [..., K/32] without 0xFF, dtype a floating dtype."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 (two E2M1 codes per byte), got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] == 0 or (2 * packed.shape[-1]) % BLOCK_SIZE:
        raise ValueError(
            f"packed must have a last dim K/2 with K a positive multiple of {BLOCK_SIZE}, "
            f"got shape {tuple(packed.shape)}"
        )
    check_scales(scales, packed.shape, 2 * packed.shape[-1], "scales")
    if scales.device != packed.device:
        raise ValueError(f"scales must be on the device of packed ({packed.device}), got {scales.device}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    check_no_nan_scale(scales, "scales")


def quantize_mxfp4_reference(x: torch.Tensor, rule: str = "ct") -> tuple[torch.Tensor, torch.Tensor]:
    """Unvalidated MXFP4 quantisation: x float [..., K] -> (packed uint8 [..., K/2], scales uint8 [..., K/32])."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)  # [R, K]
    rows = flat.shape[0]
    packed = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, k // BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    for rs in row_chunks(rows, k):
        blocks = flat[rs].to(torch.float32).reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)  # [r, K/32, 32]
        exponent = scale_exponent(blocks.abs().amax(dim=-1), E2M1_EMAX, rule)  # [r, K/32]
        scale_bytes = encode_e8m0(exponent)
        codes = encode_e2m1(blocks / decode_e8m0(scale_bytes).unsqueeze(-1))  # [r, K/32, 32]
        packed[rs] = pack_nibbles(codes.reshape(-1, k))
        scales[rs] = scale_bytes
    return packed.reshape(*lead, k // 2), scales.reshape(*lead, k // BLOCK_SIZE)


def dequantize_mxfp4_reference(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unvalidated MXFP4 dequantisation: packed uint8 [..., K/2], scales uint8 [..., K/32] -> dtype [..., K]."""
    k = 2 * packed.shape[-1]
    lead = packed.shape[:-1]
    flat_packed = packed.reshape(-1, k // 2)  # [R, K/2]
    flat_scales = scales.reshape(-1, k // BLOCK_SIZE)  # [R, K/32]
    rows = flat_packed.shape[0]
    out = torch.empty(rows, k, dtype=dtype, device=packed.device)
    for rs in row_chunks(rows, k):
        values = decode_e2m1(unpack_nibbles(flat_packed[rs])).reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)
        scaled = values * decode_e8m0(flat_scales[rs]).unsqueeze(-1)  # [r, K/32, 32] fp32, exact
        out[rs] = scaled.reshape(-1, k).to(dtype)
    return out.reshape(*lead, k)


def quantize_mxfp4(x: torch.Tensor, rule: str = "ct") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` float [..., K] (K a multiple of 32, finite) to MXFP4.

    Returns ``(packed uint8 [..., K/2], scales uint8 [..., K/32])``. ``rule``: "ct" (compressed-tensors, the
    default) or "ocp" (strict floor(log2(amax)) - 2). Inputs are rounded to fp32 first (exact for bf16/fp16).
    """
    check_quantize_mxfp4_args(x, rule)
    return quantize_mxfp4_reference(x, rule)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise MXFP4 ``packed uint8 [..., K/2]`` with ``scales uint8 [..., K/32]`` to ``dtype [..., K]``.

    Raises ValueError if a scale is the E8M0 NaN (0xFF).
    """
    check_dequantize_mxfp4_args(packed, scales, dtype)
    return dequantize_mxfp4_reference(packed, scales, dtype)
