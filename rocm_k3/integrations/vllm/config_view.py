"""vLLM's architecture view of the configs the plugin serves (see :mod:`.arch`): registered by ``register()`` for
the model types ``kimi_k3`` / ``kimi_linear``; configs the plugin does not serve keep vLLM's own view."""

from __future__ import annotations

from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from rocm_k3.integrations.vllm.arch import expanded_head_size, served_by_plugin
from rocm_k3.model.config import MLA_QK_NOPE_HEAD_DIM, MLA_QK_ROPE_HEAD_DIM, MLA_V_HEAD_DIM


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


class ExpandedMLAConvertor(ModelArchConfigConvertorBase):
    """vLLM's architecture view of a K3 / Kimi Linear config that the plugin serves (others keep vLLM's view): not
    latent MLA; one KV head per attention head, of :func:`expanded_head_size` values. Also records
    ``layers_block_type`` ("attention" for MLA layers, "mamba" for KDA layers: vLLM's hybrid convention) on the
    text config."""

    def __init__(self, hf_config, hf_text_config, *args, **kwargs) -> None:
        super().__init__(hf_config, hf_text_config, *args, **kwargs)
        self.ours = served_by_plugin(hf_config)
        if self.ours:
            hf_text_config.layers_block_type = layers_block_type(hf_text_config)

    def is_deepseek_mla(self) -> bool:
        return False if self.ours else super().is_deepseek_mla()

    def get_head_size(self) -> int:
        if not self.ours:
            return super().get_head_size()
        cfg = self.hf_text_config
        nope = getattr(cfg, "qk_nope_head_dim", None) or MLA_QK_NOPE_HEAD_DIM
        rope = getattr(cfg, "qk_rope_head_dim", None) or MLA_QK_ROPE_HEAD_DIM
        return expanded_head_size(nope + rope, getattr(cfg, "v_head_dim", None) or MLA_V_HEAD_DIM)

    def get_total_num_kv_heads(self) -> int:
        return self.get_total_num_attention_heads() if self.ours else super().get_total_num_kv_heads()
