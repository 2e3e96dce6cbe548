"""Triton MoE: fused experts over MXFP4 (A16W4, A8W4; weights in the :mod:`.layout` made by ``prepare_weights``) or
bf16 (:mod:`.fused`, kernels in :mod:`.kernels` and :mod:`.decode`), router and activations (:mod:`.pointwise`)."""

from __future__ import annotations

from rocm_k3.triton_kernels.moe.fused import fused_moe, fused_moe_supports, prepare_weights
from rocm_k3.triton_kernels.moe.pointwise import KERNELS as _POINTWISE_KERNELS

KERNELS = {"fused_moe": (fused_moe, fused_moe_supports), **_POINTWISE_KERNELS}

__all__ = ["KERNELS", "fused_moe", "fused_moe_supports", "prepare_weights"]
