"""MXFP8 (FP8 E4M3 elements + one E8M0 scale per 32) quantise / dequantise, OCP or FNUZ, row-chunked.

Two FP8 E4M3 variants exist and the caller must say which (no default):
- OCP ``torch.float8_e4m3fn`` (gfx950, NVIDIA): max 448, has -0; scale exponent ``floor(log2(amax')) - 8``.
- FNUZ ``torch.float8_e4m3fnuz`` (gfx942 / MI300X): max 240, no negative zero (0x80 is NaN); exponent offset 7.
Per block of 32: ``e = scale_exponent(amax, offset, rule)``, ``q_i = fp8_rne(clamp(x_i / 2^e, -max, max))``;
dequantised ``x_i ~ q_i * 2^e``. ``amax'`` follows the rule of :mod:`rocm_k3.quant.e8m0` ("ct" default).

Note: with rule "ct" a value just under the rounding threshold can round up to 448 (OCP) or 224 (FNUZ), whose
mantissa is 1.75, so re-quantising a dequantised block may pick the next scale; "ocp" is idempotent.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from rocm_k3.quant.blocks import BLOCK_SIZE, check_float_input, check_scales, row_chunks
from rocm_k3.quant.e8m0 import check_no_nan_scale, check_rule, decode_e8m0, encode_e8m0, scale_exponent


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """One FP8 E4M3 variant: its largest finite value and the MX scale exponent offset (its top exponent)."""

    name: str
    max_value: float
    emax: int


FP8_FORMATS: dict[torch.dtype, FP8Format] = {
    torch.float8_e4m3fn: FP8Format("OCP e4m3fn", 448.0, 8),
    torch.float8_e4m3fnuz: FP8Format("FNUZ e4m3fnuz", 240.0, 7),
}

_FNUZ_ARCHES = ("gfx940", "gfx941", "gfx942")  # the MI300 family uses the FNUZ FP8 encodings
_OCP_ARCHES = ("gfx950",)
_NVIDIA_ARCH = re.compile(r"sm_\d+[a-z]?")  # sm_90, sm_90a, sm_100a: NVIDIA FP8 is OCP


def fp8_dtype_for_arch(arch: str) -> torch.dtype:
    """The FP8 E4M3 dtype a GPU arch computes in: gfx942 -> float8_e4m3fnuz; gfx950 and NVIDIA sm_* -> float8_e4m3fn.

    ``arch`` may carry target features (``"gfx942:sramecc+:xnack-"``) or an NVIDIA suffix (``"sm_90a"``).
    Unknown arches raise ValueError.
    """
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'gfx942', 'gfx950' or 'sm_90', got {type(arch).__name__}")
    base = arch.split(":")[0].strip().lower()
    if base in _FNUZ_ARCHES:
        return torch.float8_e4m3fnuz
    if base in _OCP_ARCHES or _NVIDIA_ARCH.fullmatch(base):
        return torch.float8_e4m3fn
    raise ValueError(f"arch {arch!r} has no known FP8 E4M3 variant; expected gfx942, gfx950 or sm_<NN>")


def fp8_format(fp8_dtype: object, name: str = "fp8_dtype") -> FP8Format:
    """Validate an FP8 dtype argument (TypeError unless float8_e4m3fn or float8_e4m3fnuz)."""
    fmt = FP8_FORMATS.get(fp8_dtype) if isinstance(fp8_dtype, torch.dtype) else None
    if fmt is None:
        raise TypeError(f"{name} must be torch.float8_e4m3fn (OCP) or torch.float8_e4m3fnuz (FNUZ), got {fp8_dtype!r}")
    return fmt


def check_quantize_mxfp8_args(x: torch.Tensor, fp8_dtype: torch.dtype, rule: str) -> None:
    """x float [..., K] (K a positive multiple of 32, finite); fp8_dtype one of the two E4M3 variants; rule."""
    check_float_input(x, "x")
    fp8_format(fp8_dtype)
    check_rule(rule)


def check_dequantize_mxfp8_args(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    """q fp8 E4M3 [..., K], scales uint8 [..., K/32] without 0xFF, dtype a floating dtype."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    fp8_format(q.dtype, "q.dtype")
    if q.dim() == 0 or q.shape[-1] == 0 or q.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"q must have a last dim K that is a positive multiple of {BLOCK_SIZE}, got shape {tuple(q.shape)}"
        )
    check_scales(scales, q.shape, q.shape[-1], "scales")
    if scales.device != q.device:
        raise ValueError(f"scales must be on the device of q ({q.device}), got {scales.device}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    check_no_nan_scale(scales, "scales")


def quantize_mxfp8_reference(
    x: torch.Tensor, fp8_dtype: torch.dtype, rule: str = "ct"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unvalidated MXFP8 quantisation: x float [..., K] -> (q fp8_dtype [..., K], scales uint8 [..., K/32])."""
    fmt = FP8_FORMATS[fp8_dtype]
    k = x.shape[-1]
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)  # [R, K]
    rows = flat.shape[0]
    q = torch.empty(rows, k, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(rows, k // BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    for rs in row_chunks(rows, k):
        blocks = flat[rs].to(torch.float32).reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)  # [r, K/32, 32]
        scale_bytes = encode_e8m0(scale_exponent(blocks.abs().amax(dim=-1), fmt.emax, rule))  # [r, K/32]
        scaled = (blocks / decode_e8m0(scale_bytes).unsqueeze(-1)).clamp(-fmt.max_value, fmt.max_value)
        if fp8_dtype == torch.float8_e4m3fnuz:
            scaled = scaled + 0.0  # -0.0 + 0.0 = +0.0: FNUZ has no negative zero (0x80 is its NaN)
        q[rs] = scaled.reshape(-1, k).to(fp8_dtype)  # round to nearest even
        scales[rs] = scale_bytes
    return q.reshape(*lead, k), scales.reshape(*lead, k // BLOCK_SIZE)


def dequantize_mxfp8_reference(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unvalidated MXFP8 dequantisation: q fp8 [..., K], scales uint8 [..., K/32] -> dtype [..., K]."""
    k = q.shape[-1]
    lead = q.shape[:-1]
    flat_q = q.reshape(-1, k)  # [R, K]
    flat_scales = scales.reshape(-1, k // BLOCK_SIZE)  # [R, K/32]
    rows = flat_q.shape[0]
    out = torch.empty(rows, k, dtype=dtype, device=q.device)
    for rs in row_chunks(rows, k):
        values = flat_q[rs].to(torch.float32).reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)  # [r, K/32, 32]
        out[rs] = (values * decode_e8m0(flat_scales[rs]).unsqueeze(-1)).reshape(-1, k).to(dtype)
    return out.reshape(*lead, k)


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype, rule: str = "ct") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` float [..., K] (K a multiple of 32, finite) to MXFP8 in ``fp8_dtype``.

    Returns ``(q fp8_dtype [..., K], scales uint8 [..., K/32])``. ``fp8_dtype`` is required:
    ``torch.float8_e4m3fn`` (OCP, max 448) or ``torch.float8_e4m3fnuz`` (FNUZ, max 240); see
    :func:`fp8_dtype_for_arch`. ``rule``: "ct" (default) or "ocp".
    """
    check_quantize_mxfp8_args(x, fp8_dtype, rule)
    return quantize_mxfp8_reference(x, fp8_dtype, rule)


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise MXFP8 ``q fp8 [..., K]`` with ``scales uint8 [..., K/32]`` to ``dtype [..., K]``.

    Raises ValueError if a scale is the E8M0 NaN (0xFF).
    """
    check_dequantize_mxfp8_args(q, scales, dtype)
    return dequantize_mxfp8_reference(q, scales, dtype)
