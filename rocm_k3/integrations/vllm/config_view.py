"""vLLM's architecture view of the configs the plugin serves (see :mod:`.arch`): registered by ``register()`` for
the model types ``kimi_k3`` / ``kimi_linear``; configs the plugin does not serve keep vLLM's own view."""

from __future__ import annotations

from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from rocm_k3.integrations.vllm.arch import MLAPath, choose_mla_path, expanded_head_size, layers_block_type, \
    served_by_plugin
from rocm_k3.model.config import MLA_QK_NOPE_HEAD_DIM, MLA_QK_ROPE_HEAD_DIM, MLA_V_HEAD_DIM
from rocm_k3.settings import get_settings


def mla_path_here(text_config) -> MLAPath:
    """:func:`~.arch.choose_mla_path` on the platform this process runs on (ROCM_K3_VLLM_MLA, VLLM_MLA_DISABLE)."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    where = "the CPU" if current_platform.is_cpu() else str(current_platform.device_name)
    return choose_mla_path(text_config, is_cpu=current_platform.is_cpu(), where=where,
                           mode=get_settings().vllm_mla, mla_disabled=bool(envs.VLLM_MLA_DISABLE))


class RocmK3ArchConvertor(ModelArchConfigConvertorBase):
    """vLLM's architecture view of a K3 / Kimi Linear config that the plugin serves (others keep vLLM's view):
    latent MLA (one 576-wide KV head) when :func:`mla_path_here` chooses vLLM's MLA layer, else one KV head per
    attention head of :func:`expanded_head_size` values. Also records ``layers_block_type`` ("attention" for MLA
    layers, "mamba" for KDA layers: vLLM's hybrid convention) on the text config."""

    def __init__(self, hf_config, hf_text_config, *args, **kwargs) -> None:
        super().__init__(hf_config, hf_text_config, *args, **kwargs)
        self.ours = served_by_plugin(hf_config)
        self.latent = False
        if self.ours:
            hf_text_config.layers_block_type = layers_block_type(hf_text_config)
            self.latent = mla_path_here(hf_text_config).latent

    def is_deepseek_mla(self) -> bool:
        return self.latent if self.ours else super().is_deepseek_mla()

    def get_head_size(self) -> int:
        if not self.ours:
            return super().get_head_size()
        cfg = self.hf_text_config
        nope = getattr(cfg, "qk_nope_head_dim", None) or MLA_QK_NOPE_HEAD_DIM
        rope = getattr(cfg, "qk_rope_head_dim", None) or MLA_QK_ROPE_HEAD_DIM
        if self.latent:
            return int(cfg.kv_lora_rank) + rope
        return expanded_head_size(nope + rope, getattr(cfg, "v_head_dim", None) or MLA_V_HEAD_DIM)

    def get_total_num_kv_heads(self) -> int:
        if not self.ours:
            return super().get_total_num_kv_heads()
        return 1 if self.latent else self.get_total_num_attention_heads()
