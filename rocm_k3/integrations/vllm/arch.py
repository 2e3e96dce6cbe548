"""Which architectures the plugin serves, and how vLLM must see their attention layers.

vLLM's own Kimi K3 / Kimi Linear classes cannot run on CPUs (their MLA CPU backend takes 16-token blocks while
the hybrid KDA page forces far larger ones, and their linear layers import CUDA-only GEMMs). The plugin therefore
takes the released architecture names on the CPU, and on every platform with ``ROCM_K3_VLLM_OVERRIDE=1``; its own
names (:data:`PLUGIN_ARCHS`) are always registered, for ``--hf-overrides '{"architectures": [...]}'``.

MLA runs one of two ways, chosen once per model by :func:`choose_mla_path` (and logged):
- latent: vLLM's own MLA layer (``MLAAttention``: the 576-wide latent cached, absorbed decode) where the platform's
  MLA backends take the model's KV page: on GPU platforms (their backends split vLLM's hybrid page into kernel
  blocks), and on the CPU for a model without KDA layers whose latent is 512 + 64 wide (the CPU MLA backend's only
  width, 16-token blocks: a hybrid KDA page forces larger ones);
- expanded: vLLM's standard ``Attention`` with expanded heads (:mod:`.mla_layer`): per head the key is
  ``k_nope | k_pe`` and the value is padded to the same width, so vLLM sizes its KV pages for
  ``num_attention_heads`` KV heads of :func:`expanded_head_size` values and does not treat the model as latent MLA.
:class:`~.config_view.RocmK3ArchConvertor` gives vLLM the view of the config that matches the choice.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass

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


def layers_block_type(text_config) -> list[str]:
    """Per layer "attention" (MLA) or "mamba" (KDA), from ``linear_attn_config.full_attn_layers`` (1-based) or
    transformers' expanded ``layer_types``."""
    n = getattr(text_config, "num_hidden_layers", 0)
    lin = getattr(text_config, "linear_attn_config", None) or {}
    if lin.get("full_attn_layers") is not None:
        full = {i - 1 for i in lin["full_attn_layers"]}
    else:
        types = getattr(text_config, "layer_types", None) or []
        full = {i for i, kind in enumerate(types) if kind == "full_attention"}
    return ["attention" if i in full else "mamba" for i in range(n)]


# The CPU MLA backend's decode kernel: latent 512 + rope 64 only, 16-token kernel blocks only.
CPU_MLA_LATENT_WIDTH = 576


@dataclass(frozen=True)
class MLAPath:
    """How the plugin runs MLA on this platform: ``latent`` (vLLM's MLA layer) or not (expanded heads), and why."""

    latent: bool
    reason: str

    @property
    def name(self) -> str:
        return "latent" if self.latent else "expanded"


def choose_mla_path(text_config, *, is_cpu: bool, where: str, mode: str = "auto",
                    mla_disabled: bool = False) -> MLAPath:
    """The MLA path for a served config (see the module docstring). ``mode`` is ROCM_K3_VLLM_MLA (auto, latent,
    expanded); ``mla_disabled`` is vLLM's VLLM_MLA_DISABLE. A forced "latent" that this platform's MLA backend cannot
    run is a ValueError naming the reason."""
    from rocm_k3.model.config import MLA_QK_ROPE_HEAD_DIM

    kinds = layers_block_type(text_config)
    hybrid = "mamba" in kinds
    rope = getattr(text_config, "qk_rope_head_dim", None) or MLA_QK_ROPE_HEAD_DIM
    width = int(getattr(text_config, "kv_lora_rank", 0) or 0) + rope
    if mla_disabled:
        if mode == "latent":
            raise ValueError("ROCM_K3_VLLM_MLA=latent contradicts VLLM_MLA_DISABLE=1")
        return MLAPath(False, "VLLM_MLA_DISABLE=1")
    if mode == "expanded":
        return MLAPath(False, "ROCM_K3_VLLM_MLA=expanded")
    if is_cpu:
        blockers = []
        if hybrid:
            blockers.append("its KDA layers force a hybrid page far above the 16-token blocks the CPU MLA backend "
                            "takes")
        if width != CPU_MLA_LATENT_WIDTH:
            blockers.append(f"its latent is {width} wide and the CPU MLA decode kernel takes only "
                            f"{CPU_MLA_LATENT_WIDTH}")
        if blockers:
            if mode == "latent":
                raise ValueError("ROCM_K3_VLLM_MLA=latent: vLLM's MLA layer cannot run this model on the CPU: "
                                 + "; ".join(blockers))
            return MLAPath(False, "vLLM's CPU MLA backend cannot run this model: " + "; ".join(blockers))
        return MLAPath(True, f"vLLM's CPU MLA backend takes this model (no KDA layers, latent {width} wide)"
                       if mode == "auto" else "ROCM_K3_VLLM_MLA=latent")
    return MLAPath(True, f"vLLM's MLA backends on {where} split the hybrid page into kernel blocks"
                   if mode == "auto" else "ROCM_K3_VLLM_MLA=latent")
