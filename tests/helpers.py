"""Shared test helpers: the one relative-error metric, poisoning, seeded inputs."""

from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64; NaN or Inf anywhere in ``out`` gives inf (never passes)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape mismatch: out {tuple(out64.shape)} vs ref {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return math.inf
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if denom == 0.0:
        return num
    return num / denom


def assert_rel(out: torch.Tensor, ref: torch.Tensor, tol: float, name: str = "output") -> None:
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > tolerance {tol:.1e}"


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN (or max int), so an unwritten element can never pass."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).max)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
