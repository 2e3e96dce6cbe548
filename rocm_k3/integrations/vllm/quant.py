"""``rocm_k3_mxfp4``: the quantization method for the MXFP4 routed experts of the checkpoints the plugin serves.

K3's experts are compressed-tensors ``mxfp4-pack-quantized`` (uint8 codes + E8M0 scales per 32 values). vLLM's own
``mxfp4`` method refuses float32 and CPUs, and its compressed-tensors path builds vLLM's FusedMoE. The plugin's
model keeps rocm-k3's MoE layer: its loader reads the codes and scales into the layer's uint8 parameters and the
serving backend re-lays them once (``prepare_weights``), and the ops run them (reference on the CPU, Triton on
NVIDIA, FlyDSL on AMD). So this method claims such checkpoints (``override_quantization_method``) when the
plugin serves their architecture, accepts every activation dtype and hands no vLLM layer a quantized method.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from rocm_k3.integrations.vllm.arch import served_by_plugin
from rocm_k3.model.config import ConfigError, parse_expert_format

METHOD = "rocm_k3_mxfp4"


def is_mxfp4_experts(quant: dict[str, Any]) -> bool:
    """A compressed-tensors ``mxfp4-pack-quantized`` config, as the checkpoint has it or as vLLM normalises it
    (``quant_method`` "mxfp4" for the K3 config)."""
    if not isinstance(quant, dict) or quant.get("quant_method") not in ("compressed-tensors", "mxfp4"):
        return False
    try:
        return parse_expert_format({**quant, "quant_method": "compressed-tensors"}) == "mxfp4"
    except ConfigError:
        return False


@register_quantization_config(METHOD)
class RocmK3MXFP4Config(QuantizationConfig):
    """The checkpoint's ``quantization_config`` (compressed-tensors MXFP4), validated by rocm-k3's config reader."""

    def __init__(self, raw: dict[str, Any]) -> None:
        super().__init__()
        self.raw = raw

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RocmK3MXFP4Config:
        if not is_mxfp4_experts(config):
            raise ConfigError(f"{METHOD}: expected a compressed-tensors mxfp4-pack-quantized quantization_config, "
                              f"got {config!r}")
        return cls(dict(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        if user_quant not in (None, METHOD, "compressed-tensors") or hf_config is None:
            return None
        return METHOD if served_by_plugin(hf_config) and is_mxfp4_experts(hf_quant_cfg) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return None  # rocm-k3's layers own their weights; vLLM's layers (attention) stay unquantized
