"""Small launch-time facts shared by the Triton kernels."""

from __future__ import annotations

from typing import Any


def interpreted(kernel: Any) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (Triton reads it at decoration time).

    The interpreter multiplies raw bit patterns in a bf16 ``tl.dot``, so kernels feed such dots fp32 operands
    when this is true (``DOT_F32`` constexpr); compiled kernels keep bf16 operands.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
