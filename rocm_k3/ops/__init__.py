"""The op interface: every op the K3 forward pass needs, one module per family.

The model calls ``rocm_k3.ops.<op>(..., backend=None)``; each op validates its inputs and dispatches to the
backend chosen per call (see :mod:`rocm_k3.ops.registry`). Families:
``quant`` (MXFP4/MXFP8), ``norm`` (rms_norm, add_rms_norm), ``moe`` (route, situ_and_mul, silu_and_mul, fused_moe),
``kda`` (kda_gate, short_conv, short_conv_update, kda_prefill, kda_decode, gated_rms_norm),
``attn_res`` (attn_res_mix, attn_res_step), ``mla`` (mla_write_cache, mla_prefill, mla_decode),
``vision_attention`` (varlen_attention: the vision tower's per-image bidirectional attention).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "quantize_mxfp4": "quant", "dequantize_mxfp4": "quant", "quantize_mxfp8": "quant", "dequantize_mxfp8": "quant",
    "rms_norm": "norm", "add_rms_norm": "norm",
    "route": "moe", "situ_and_mul": "moe", "silu_and_mul": "moe", "fused_moe": "moe", "prepare_expert_weights": "moe",
    "ExpertWeights": "moe", "MoEActivation": "moe", "RouteResult": "moe",
    "kda_gate": "kda", "short_conv": "kda", "short_conv_update": "kda", "kda_prefill": "kda",
    "kda_decode": "kda", "gated_rms_norm": "kda", "KDAPrefillOutput": "kda", "KDAGateParams": "kda",
    "attn_res_mix": "attn_res", "attn_res_step": "attn_res",
    "mla_write_cache": "mla", "mla_prefill": "mla", "mla_decode": "mla",
    "all_reduce": "comm", "all_gather": "comm", "reduce_scatter": "comm", "all_to_all": "comm",
    "varlen_attention": "vision_attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    family = _EXPORTS.get(name)
    if family is None:
        raise AttributeError(f"module 'rocm_k3.ops' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rocm_k3.ops.{family}"), name)
