"""The ``quant`` op family: MXFP4 and MXFP8 quantise / dequantise, dispatched per call.

The math, layouts and scale rules live in :mod:`rocm_k3.quant` (E2M1 codes, E8M0 scales, OCP and FNUZ FP8);
this module validates at the op boundary, then dispatches to the backend chosen by
:mod:`rocm_k3.ops.registry`. The reference implementations are the ``*_reference`` functions of that package.

- ``quantize_mxfp4(x [..., K], rule="ct") -> (packed uint8 [..., K/2], scales uint8 [..., K/32])``
- ``dequantize_mxfp4(packed, scales, dtype=fp32) -> [..., K]``
- ``quantize_mxfp8(x [..., K], fp8_dtype, rule="ct") -> (q fp8 [..., K], scales uint8 [..., K/32])``
- ``dequantize_mxfp8(q, scales, dtype=fp32) -> [..., K]``
"""

from __future__ import annotations

import torch

from rocm_k3.ops import registry
from rocm_k3.quant import (
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E8M0_NAN,
    FP8_FORMATS,
    SCALE_RULES,
    fp8_dtype_for_arch,
)
from rocm_k3.quant.mxfp4 import (
    check_dequantize_mxfp4_args,
    check_quantize_mxfp4_args,
    dequantize_mxfp4_reference,
    quantize_mxfp4_reference,
)
from rocm_k3.quant.mxfp8 import (
    check_dequantize_mxfp8_args,
    check_quantize_mxfp8_args,
    dequantize_mxfp8_reference,
    quantize_mxfp8_reference,
)

__all__ = ["BLOCK_SIZE", "E2M1_MAGNITUDES", "E2M1_MAX", "E8M0_NAN", "FP8_FORMATS", "REFERENCE_IMPLS", "SCALE_RULES",
           "dequantize_mxfp4", "dequantize_mxfp8", "fp8_dtype_for_arch", "quantize_mxfp4", "quantize_mxfp8"]


def quantize_mxfp4(
    x: torch.Tensor, rule: str = "ct", *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantise ``x`` float [..., K] (K a positive multiple of 32, finite values).

    Returns ``(packed uint8 [..., K/2], scales uint8 [..., K/32])``: E2M1 codes, low nibble = even element,
    round to nearest even saturating at 6; E8M0 scale per 32 by ``rule`` "ct" (default) or "ocp".
    """
    check_quantize_mxfp4_args(x, rule)
    return registry.dispatch("quantize_mxfp4", backend, x, rule)


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *, backend: str | None = None
) -> torch.Tensor:
    """``packed uint8 [..., K/2]``, ``scales uint8 [..., K/32]`` -> ``dtype [..., K]``.

    A 0xFF (NaN) scale raises ValueError.
    """
    check_dequantize_mxfp4_args(packed, scales, dtype)
    return registry.dispatch("dequantize_mxfp4", backend, packed, scales, dtype)


def quantize_mxfp8(
    x: torch.Tensor, fp8_dtype: torch.dtype, rule: str = "ct", *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantise ``x`` float [..., K] to ``fp8_dtype``.

    ``fp8_dtype``: float8_e4m3fn (OCP, max 448) or float8_e4m3fnuz (FNUZ, max 240).

    Returns ``(q fp8_dtype [..., K], scales uint8 [..., K/32])``; scale exponent offset 8 (OCP) or 7 (FNUZ).
    """
    check_quantize_mxfp8_args(x, fp8_dtype, rule)
    return registry.dispatch("quantize_mxfp8", backend, x, fp8_dtype, rule)


def dequantize_mxfp8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *, backend: str | None = None
) -> torch.Tensor:
    """``q fp8 [..., K]``, ``scales uint8 [..., K/32]`` -> ``dtype [..., K]``; a 0xFF (NaN) scale raises ValueError."""
    check_dequantize_mxfp8_args(q, scales, dtype)
    return registry.dispatch("dequantize_mxfp8", backend, q, scales, dtype)


REFERENCE_IMPLS = {
    "quantize_mxfp4": quantize_mxfp4_reference,
    "dequantize_mxfp4": dequantize_mxfp4_reference,
    "quantize_mxfp8": quantize_mxfp8_reference,
    "dequantize_mxfp8": dequantize_mxfp8_reference,
}
