"""ModelConfig from HF config.json: the released K3 and Kimi Linear configurations, and named errors."""

from __future__ import annotations

import copy

import pytest

from rocm_k3.model.config import ConfigError, ModelConfig, UnsupportedModelError

# The released configurations as K3_SPEC section 1 lists them (text_config of Kimi K3; plain Kimi Linear).
K3_MLA_1BASED = list(range(4, 93, 4)) + [93]
K3_TEXT = {
    "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840,
    "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "first_k_dense_replace": 1, "intermediate_size": 33792,
    "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "num_expert_group": 1, "topk_group": 1,
    "moe_renormalize": True, "routed_scaling_factor": 1.0, "hidden_act": "situ", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "linear_attn_config": {
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True, "full_attn_layers": K3_MLA_1BASED,
        "kda_layers": [i for i in range(1, 94) if i not in K3_MLA_1BASED],
    },
}
K3_TOP = {
    "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": K3_TEXT,
    "vision_config": {"model_type": "moonvit"}, "media_placeholder_token_id": 163605,
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                      "weights": {"num_bits": 4, "group_size": 32, "type": "float"}}},
    },
}
KL_MLA_1BASED = [4, 8, 12, 16, 20, 24, 27]
KIMI_LINEAR = {
    "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27, "vocab_size": 163840,
    "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "num_experts": 256,
    "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024, "first_k_dense_replace": 1,
    "intermediate_size": 9216, "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
    "moe_renormalize": True, "routed_scaling_factor": 2.446, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "full_attn_layers": KL_MLA_1BASED,
                           "kda_layers": [i for i in range(1, 28) if i not in KL_MLA_1BASED]},
}


def test_k3_released_config() -> None:
    cfg = ModelConfig.from_hf_dict(K3_TOP)
    assert cfg.is_k3 and cfg.weight_prefix == "language_model." and cfg.expert_format == "mxfp4"
    assert len(cfg.mla_layers) == 24 and len(cfg.kda_layers) == 69
    assert cfg.mla_layers[0] == 3 and cfg.mla_layers[-2:] == (91, 92)  # 1-based 4 -> 3; 92, 93 -> 91, 92
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.full_rank_gate
    assert cfg.expert_hidden_size == 3584 and cfg.num_attn_res_blocks == 8  # ceil(93 / 12): 8 blocks + p
    assert cfg.hidden_act == "situ" and cfg.situ_linear_beta == 25.0
    assert cfg.layer_slot(3) == 0 and cfg.layer_slot(0) == 0 and cfg.layer_slot(4) == 3


def test_kimi_linear_released_config() -> None:
    cfg = ModelConfig.from_hf_dict(KIMI_LINEAR)
    assert not cfg.is_k3 and cfg.weight_prefix == "" and cfg.expert_format == "bf16"
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26) and len(cfg.kda_layers) == 20
    assert cfg.kda.gate_lower_bound is None and not cfg.kda.full_rank_gate
    assert cfg.q_lora_rank is None and cfg.routed_expert_hidden_size is None and not cfg.uses_attn_res
    assert cfg.expert_hidden_size == 2304 and cfg.routed_scaling_factor == 2.446


def _k3_with(**text_changes: object) -> dict:
    raw = copy.deepcopy(K3_TOP)
    for key, value in text_changes.items():
        if key.startswith("lin_"):
            raw["text_config"]["linear_attn_config"][key[4:]] = value
        else:
            raw["text_config"][key] = value
    return raw


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"lin_full_attn_layers": K3_MLA_1BASED + [94]}, r"full_attn_layers.*\[94\].*outside 1\.\.93"),
        ({"lin_kda_layers": [0, 1, 2]}, r"1-based"),
        ({"lin_kda_layers": [1, 2]}, r"neither MLA nor KDA"),
        ({"lin_kda_layers": [1, 2, 3, 4] + [i for i in range(5, 94) if i not in K3_MLA_1BASED]},
         r"both MLA and KDA"),
        ({"num_experts_per_token": 897}, r"num_experts_per_token.*1\.\.num_experts \(896\).*897"),
        ({"lin_head_dim": 0}, r"linear_attn_config.head_dim"),
        ({"hidden_act": "gelu"}, r"hidden_act"),
        ({"lin_gate_lower_bound": 1.0}, r"gate_lower_bound"),
        ({"routed_expert_hidden_size": 3580}, r"multiple of 32"),
    ],
    ids=["mla-layer-out-of-range", "zero-based-list", "uncovered-layers", "overlap", "topk-gt-experts",
         "kda-head-dim", "activation", "gate-bound", "latent-not-mxfp4-aligned"],
)
def test_config_errors(changes: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(_k3_with(**changes))


def test_unsupported_model_type() -> None:
    with pytest.raises(UnsupportedModelError, match=r"model_type.*'llama'"):
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 8})
    bad_text = copy.deepcopy(K3_TOP)
    bad_text["text_config"]["model_type"] = "deepseek_v3"
    with pytest.raises(UnsupportedModelError, match="text_config.model_type"):
        ModelConfig.from_hf_dict(bad_text)


def test_unsupported_quantization() -> None:
    raw = copy.deepcopy(K3_TOP)
    raw["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(ConfigError, match="quant_method"):
        ModelConfig.from_hf_dict(raw)
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int4-pack-quantized"}
    with pytest.raises(ConfigError, match="mxfp4-pack-quantized"):
        ModelConfig.from_hf_dict(raw)


# ------------------------------------------------------------------------------- value types (one table)
@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_shared_experts": "2"}, r"num_shared_experts: expected an integer, got '2' \(str\)"),
        ({"lin_gate_lower_bound": "-5"}, r"linear_attn_config.gate_lower_bound: expected a number or null, got '-5' \(str\)"),
        ({"hidden_size": True}, r"hidden_size: expected an integer, got True \(bool\)"),
        ({"num_experts": 896.0}, r"num_experts: expected an integer, got 896.0 \(float\)"),
        ({"routed_scaling_factor": "1.0"}, r"routed_scaling_factor: expected a number, got '1.0' \(str\)"),
        ({"routed_scaling_factor": False}, r"routed_scaling_factor: expected a number, got False \(bool\)"),
        ({"mla_use_output_gate": "false"}, r"mla_use_output_gate: expected true or false, got 'false' \(str\)"),
        ({"mla_use_output_gate": 1}, r"mla_use_output_gate: expected true or false, got 1 \(int\)"),
        ({"lin_use_full_rank_gate": "yes"}, r"linear_attn_config.use_full_rank_gate: expected true or false"),
        ({"hidden_act": 3}, r"hidden_act: expected a string, got 3 \(int\)"),
        ({"q_lora_rank": "1536"}, r"q_lora_rank: expected an integer or null, got '1536' \(str\)"),
        ({"lin_num_heads": 96.5}, r"linear_attn_config.num_heads: expected an integer, got 96.5"),
        ({"lin_short_conv_kernel_size": "4"}, r"linear_attn_config.short_conv_kernel_size: expected an integer"),
        ({"eos_token_id": "2"}, r"eos_token_id: expected an integer or a list of integers, got '2' \(str\)"),
        ({"eos_token_id": [1, "2"]}, r"eos_token_id: expected an integer or a list of integers, got \[1, '2'\]"),
        ({"num_expert_group": "1"}, r"num_expert_group: expected an integer, got '1' \(str\)"),
        ({"mla_use_nope": "true"}, r"mla_use_nope: expected true or false, got 'true' \(str\)"),
        ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps: expected a number, got '1e-5' \(str\)"),
        ({"lin_full_attn_layers": "4, 8"}, r"full_attn_layers: expected a list of 1-based layer numbers"),
        ({"activation_situ_linear_beta": [25.0]}, r"activation_situ_linear_beta: expected a number or null"),
        ({"max_position_embeddings": "1M"}, r"max_position_embeddings: expected an integer, got '1M'"),
        ({"linear_attn_config": [1, 2]}, r"linear_attn_config: expected an object, got \[1, 2\] \(list\)"),
    ],
    ids=["shared-str", "gate-bound-str", "bool-for-int", "float-for-int", "scale-str", "scale-bool", "bool-str",
         "bool-int", "full-rank-str", "act-int", "q-lora-str", "heads-float", "conv-str", "eos-str", "eos-list-str",
         "groups-str", "nope-str", "eps-str", "layers-str", "linear-beta-list", "max-pos-str", "lin-cfg-list"],
)
def test_config_value_of_the_wrong_type(changes: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(_k3_with(**changes))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"routed_scaling_factor": -1.0}, r"routed_scaling_factor: expected a finite number > 0, got -1.0"),
        ({"routed_scaling_factor": 0}, r"routed_scaling_factor: expected a finite number > 0, got 0"),
        ({"routed_scaling_factor": float("nan")}, r"routed_scaling_factor: expected a finite number, got nan"),
        ({"routed_scaling_factor": float("inf")}, r"routed_scaling_factor: expected a finite number, got inf"),
        ({"rms_norm_eps": float("nan")}, r"rms_norm_eps: expected a finite number, got nan"),
        ({"lin_gate_lower_bound": float("-inf")}, r"gate_lower_bound: expected a finite number, got -inf"),
        ({"activation_situ_beta": 0.0}, r"activation_situ_beta: expected a finite number > 0, got 0.0"),
        ({"activation_situ_linear_beta": -25.0}, r"activation_situ_linear_beta: expected .*> 0.*-25.0"),
        ({"num_shared_experts": -1}, r"num_shared_experts: expected >= 0, got -1"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank: expected a positive integer, got 0"),
        ({"v_head_dim": -128}, r"v_head_dim: expected a positive integer, got -128"),
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers: expected at most 4096, got 1000000000000"),
        ({"rms_norm_eps": 10**400}, r"rms_norm_eps: expected a finite number, got 1000"),
    ],
    ids=["scale-neg", "scale-zero", "scale-nan", "scale-inf", "eps-nan", "bound-inf", "situ-zero", "lin-beta-neg",
         "shared-neg", "lora-zero", "v-neg", "layers-huge", "eps-huge-int"],
)
def test_config_value_out_of_range(changes: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(_k3_with(**changes))


def test_config_nan_in_the_file_is_refused_at_load(tmp_path) -> None:
    """Python's json reads NaN / Infinity; the config must refuse them before any request runs."""
    import json

    for bad in ("NaN", "Infinity", "-1"):
        raw = json.dumps(_k3_with()).replace('"routed_scaling_factor": 1.0', f'"routed_scaling_factor": {bad}')
        (tmp_path / "config.json").write_text(raw)
        with pytest.raises(ConfigError, match="routed_scaling_factor"):
            ModelConfig.from_pretrained(tmp_path)


def test_ints_are_accepted_for_number_fields() -> None:
    cfg = ModelConfig.from_hf_dict(_k3_with(routed_scaling_factor=2, lin_gate_lower_bound=-5, rms_norm_eps=1))
    assert cfg.routed_scaling_factor == 2.0 and isinstance(cfg.routed_scaling_factor, float)
    assert cfg.kda.gate_lower_bound == -5.0 and isinstance(cfg.kda.gate_lower_bound, float)


def test_any_mla_latent_geometry_is_accepted() -> None:
    """The MLA widths come from the config (the ops take them from the tensor shapes)."""
    cfg = ModelConfig.from_hf_dict(_k3_with(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                            v_head_dim=24))
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_head_dim, cfg.v_head_dim) == (32, 16, 48, 24)
    assert cfg.mla_latent_width == 48
