"""Argument checks shared by the op families' public functions (shapes, dtypes and devices only: no device sync)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_like(ref_name: str, ref: torch.Tensor, others: Mapping[str, torch.Tensor]) -> None:
    """Each of ``others`` (name -> tensor) has the shape, dtype and device of ``ref``; the first that differs is a
    ValueError (shape, device) or TypeError (dtype) naming both tensors."""
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {ref_name} {list(ref.shape)}, got {list(t.shape)}")
        if t.dtype != ref.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match {ref_name} dtype {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all must share a device")
