"""Triton kernels of the KDA op family.

``KERNELS`` maps each op name to ``(implementation, supports)``; both take the op's contract signature
(minus ``backend``) and :mod:`rocm_k3.triton_kernels.backend` registers them. Files, by phase:
``gate.py`` (kda_gate), ``short_conv.py`` (short_conv, short_conv_update), ``chunk_prep.py`` /
``chunk_intra.py`` / ``chunk_solve.py`` / ``chunk_state.py`` (+ optional ``chunk_output.py``): the phases of the
chunked prefill, driven by
``prefill.py``; ``decode.py`` (the fused one-kernel decode step); ``common.py``
(shared device helpers and the varlen chunk plan). Tuning knobs (measured on the H200) sit beside the kernels:
``prefill.PHASE_WARPS`` / ``prefill.state_tile`` / ``prefill.STATE_STAGES`` / ``prefill.PREP_BK`` /
``prefill.PREP_SPLIT`` / ``prefill.SOLVE_KB`` / ``prefill.SPLIT_OUTPUT`` / ``prefill.INTRA_INVERTS`` /
``prefill.SOLVE_IN_WALK`` / ``prefill.INVERT_BY_PRODUCTS`` / ``prefill.SOLVE_WALK_STAGES`` /
``prefill.NORMS_IN_INTRA`` / ``prefill.BAND_IN_DOT_DTYPE`` and
``decode.DECODE_WARPS`` / ``decode.DECODE_PREFETCH``.
Importing this package imports triton.
"""

from __future__ import annotations

from rocm_k3.triton_kernels.kda.decode import kda_decode, supports_kda_decode
from rocm_k3.triton_kernels.kda.gate import kda_gate, supports_kda_gate
from rocm_k3.triton_kernels.kda.prefill import kda_prefill, supports_kda_prefill
from rocm_k3.triton_kernels.kda.short_conv import (
    short_conv,
    short_conv_update,
    supports_short_conv,
    supports_short_conv_update,
)

KERNELS = {
    "kda_gate": (kda_gate, supports_kda_gate),
    "short_conv": (short_conv, supports_short_conv),
    "short_conv_update": (short_conv_update, supports_short_conv_update),
    "kda_prefill": (kda_prefill, supports_kda_prefill),
    "kda_decode": (kda_decode, supports_kda_decode),
}

__all__ = ["KERNELS"]
