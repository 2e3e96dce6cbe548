"""Which architectures the plugin serves, and how vLLM must see their attention layers.

vLLM's own Kimi K3 / Kimi Linear classes cannot run on CPUs (their MLA CPU backend takes 16-token blocks while
the hybrid KDA page forces far larger ones, and their linear layers import CUDA-only GEMMs). The plugin therefore
takes the released architecture names on the CPU, and on every platform with ``ROCM_K3_VLLM_OVERRIDE=1``; its own
names (:data:`PLUGIN_ARCHS`) are always registered, for ``--hf-overrides '{"architectures": [...]}'``.

MLA runs as expanded-head attention through vLLM's standard ``Attention`` (:mod:`.mla_layer`): per head the key is
``k_nope | k_pe`` and the value is padded to the same width, so vLLM must size its KV pages for
``num_attention_heads`` KV heads of :func:`expanded_head_size` values and not treat the model as latent MLA.
:class:`~.config_view.ExpandedMLAConvertor` is that view of the config.
"""

from __future__ import annotations

import logging

from rocm_k3.settings import get_settings

logger = logging.getLogger("vllm.plugins.rocm_k3")  # under vLLM's logger: its handlers and level

K3_ARCH = "KimiK3ForConditionalGeneration"
KIMI_LINEAR_ARCH = "KimiLinearForCausalLM"
MODEL_CLASSES = {  # released architecture name -> the plugin's class
    K3_ARCH: "rocm_k3.integrations.vllm.model:RocmK3KimiK3ForConditionalGeneration",
    KIMI_LINEAR_ARCH: "rocm_k3.integrations.vllm.model:RocmK3KimiLinearForCausalLM",
}
PLUGIN_ARCHS = {  # the plugin's own architecture names (always registered)
    "RocmK3KimiK3ForConditionalGeneration": MODEL_CLASSES[K3_ARCH],
    "RocmK3KimiLinearForCausalLM": MODEL_CLASSES[KIMI_LINEAR_ARCH],
}
SERVED_MODEL_TYPES = ("kimi_k3", "kimi_linear")
# Head sizes every vLLM attention backend takes (the CPU backend's list is the narrowest).
ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def takes_released_names(is_cpu: bool) -> tuple[bool, str]:
    """Whether the plugin registers under the released architecture names here, and why (for the log)."""
    if get_settings().vllm_override:
        return True, "ROCM_K3_VLLM_OVERRIDE=1"
    if is_cpu:
        return True, "vLLM's own Kimi K3 / Kimi Linear classes cannot run on the CPU"
    return False, "vLLM's own classes serve this platform (set ROCM_K3_VLLM_OVERRIDE=1 to use rocm-k3's)"


def expanded_head_size(q_head_dim: int, v_head_dim: int) -> int:
    """The smallest attention head size every backend takes that holds the query/key (nope + rope) and value dims."""
    need = max(q_head_dim, v_head_dim)
    for size in ATTENTION_HEAD_SIZES:
        if size >= need:
            return size
    raise ValueError(f"MLA head dims q {q_head_dim} / v {v_head_dim} exceed the largest attention head size "
                     f"{ATTENTION_HEAD_SIZES[-1]} vLLM's backends take")


def served_by_plugin(hf_config) -> bool:
    """Whether the plugin's classes serve this HF config (its architecture is a plugin name, or a released name
    the plugin takes here)."""
    from vllm.platforms import current_platform

    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch in PLUGIN_ARCHS:
        return True
    return arch in MODEL_CLASSES and takes_released_names(current_platform.is_cpu())[0]
