"""MX block layout shared by MXFP4 and MXFP8: 32 elements per scale along the last dim, row-chunked loops.

The quantisers flatten ``[..., K]`` to ``[R, K]`` rows and work on row chunks of a bounded element count, so
quantising a whole expert (e.g. 6144 x 3584) never materialises more than a few fp32 chunk-sized temporaries.
"""

from __future__ import annotations

from typing import Iterator

import torch

BLOCK_SIZE = 32
CHUNK_ELEMENTS = 1 << 21  # elements per row chunk (8 MiB of fp32 per temporary)


def check_float_input(x: object, name: str = "x") -> torch.Tensor:
    """Validate a tensor to quantise: floating dtype, >= 1 dim, last dim a positive multiple of 32, finite."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype.itemsize < 2:
        raise TypeError(f"{name} must be bf16, fp16, fp32 or fp64, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"{name} must have a last dim K that is a positive multiple of {BLOCK_SIZE}, got shape {tuple(x.shape)}"
        )
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf; MX quantisation needs finite inputs")
    return x


def check_scales(scales: object, data_shape: torch.Size, k: int, name: str = "scales") -> torch.Tensor:
    """Validate uint8 scales ``[..., K/32]`` matching the leading dims of the data."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (E8M0 bytes), got {scales.dtype}")
    expected = (*data_shape[:-1], k // BLOCK_SIZE)
    if tuple(scales.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for K={k}, got {tuple(scales.shape)}")
    return scales


def row_chunks(rows: int, cols: int, budget: int | None = None) -> Iterator[slice]:
    """Slices of ``range(rows)`` holding at most ``budget`` (default CHUNK_ELEMENTS) elements each, >= 1 row."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    step = max(1, budget // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))
