"""Triton fused MoE over MXFP4 (A16W4, A8W4) or bf16 experts; see :mod:`.fused` for the pipeline."""

from __future__ import annotations

from rocm_k3.triton_kernels.moe.fused import fused_moe, fused_moe_supports, prepare_weights

KERNELS = {"fused_moe": (fused_moe, fused_moe_supports)}

__all__ = ["KERNELS", "fused_moe", "fused_moe_supports", "prepare_weights"]
