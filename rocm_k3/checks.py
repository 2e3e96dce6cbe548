"""Checks of configuration values that every layer shares (the lowest layer: imports nothing of rocm_k3)."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, low: int = 1, high: int | None = None, *,
              error: type[Exception] = ValueError) -> int:
    """``value`` when it is an int (a bool is not) in ``[low, high]`` (``high`` None: no upper bound); otherwise
    ``error`` naming ``name``, the range and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        if high is not None:
            wanted = f"an int in [{low}, {high}]"
        else:
            wanted = "a positive int" if low == 1 else f"an int >= {low}"
        raise error(f"{name}: expected {wanted}, got {value!r}")
    return value
