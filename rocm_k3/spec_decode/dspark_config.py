"""The config and tensor layout of a released K3 DSpark drafter (``model_type`` ``k3_dspark``, ``K3DSparkModel``).

Public facts (the ``Inferact/Kimi-K3-DSpark`` config.json and its 68-tensor safetensors header, as other serving
stacks pin and load them): five dense DeepSeek-V3-style MLA decoder layers with YaRN RoPE, a
``context_proj`` / ``context_norm`` that fuse the target's hidden states at ``target_layer_ids`` (the residual stream
after those layers), a ``final_norm``, and a rank-``markov_rank`` Markov head (``markov_w1`` embeds the previous
token, ``markov_w2`` maps it to a vocabulary bias). The token embedding and LM head are the target's (the checkpoint
ships a copy of the embedding, ``embed_tokens.weight``, and a training-only ``confidence_head``: both are read past).

Tensor names and shapes (H hidden, I intermediate, n heads, Q q_lora_rank, R kv_lora_rank, P qk_rope_head_dim,
Dn qk_nope_head_dim, Dv v_head_dim, V vocab, r markov_rank, k taps, Ht target hidden)::

    context_proj.weight                        [H, k * Ht]
    context_norm.weight, final_norm.weight     [H]
    layers.{i}.input_layernorm.weight          [H]        layers.{i}.post_attention_layernorm.weight  [H]
    layers.{i}.self_attn.q_a_proj.weight       [Q, H]     layers.{i}.self_attn.q_a_layernorm.weight   [Q]
    layers.{i}.self_attn.q_b_proj.weight       [n (Dn + P), Q]
    layers.{i}.self_attn.kv_a_proj_with_mqa.weight  [R + P, H]   layers.{i}.self_attn.kv_a_layernorm.weight [R]
    layers.{i}.self_attn.kv_b_proj.weight      [n (Dn + Dv), R]
    layers.{i}.self_attn.o_proj.weight         [H, n Dv]
    layers.{i}.mlp.gate_proj.weight / up_proj.weight  [I, H]     layers.{i}.mlp.down_proj.weight  [H, I]
    markov_head.markov_w1.weight, markov_head.markov_w2.weight  [V, r]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MODEL_TYPE = "k3_dspark"
ARCHITECTURE = "K3DSparkModel"
MAX_DRAFTS = 7  # the released drafters' block: the anchor token and seven drafts, verified as eight
# tensors the checkpoint may ship that the served drafter does not use (the target's embedding copy, a
# training-only confidence head)
IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "confidence_head.")

_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "target_hidden_size",
         "target_num_hidden_layers", "mask_token_id", "markov_rank")
_REQUIRED = (*_INTS, "target_layer_ids")


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """DeepSeek YaRN RoPE (``rope_parameters`` / ``rope_scaling`` with rope_type yarn); factor 1 is plain RoPE."""

    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        # finite (JSON's NaN / Infinity parse); theta > 1: YaRN's correction dims divide by log(theta)
        for name, low, strict in (("theta", 1, True), ("factor", 0, True), ("beta_fast", 0, True),
                                  ("beta_slow", 0, True), ("mscale", 0, False), ("mscale_all_dim", 0, False)):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value < low or (strict and value == low)):
                raise ValueError(f"DSpark config: rope {name}: expected a finite number {'>' if strict else '>='} "
                                 f"{low}, got {value!r}")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"DSpark config: rope original_max_position_embeddings: expected a positive int, "
                             f"got {value!r}")

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> YarnRope:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ValueError(f"DSpark config: rope_parameters: expected an object, got {params!r}")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = str(params.get("rope_type", params.get("type", "default"))).lower()
        if kind in ("default", "none"):
            return cls(theta=theta)
        if kind not in ("yarn", "deepseek_yarn"):
            raise ValueError(f"DSpark config: rope_parameters.rope_type {kind!r} is not supported (yarn or default)")
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        return cls(theta=theta, **{k: params[k] for k in keys if k in params})


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """The keys of a ``k3_dspark`` config.json that the drafter's shapes and forward depend on."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    target_hidden_size: int
    target_num_hidden_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    rms_norm_eps: float = 1e-5
    rope: YarnRope = YarnRope()

    def __post_init__(self) -> None:
        for name in _INTS:
            value = getattr(self, name)
            low = 0 if name == "mask_token_id" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DSpark config: {name}: expected an int >= {low}, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DSpark config: qk_rope_head_dim: expected an even int, got {self.qk_rope_head_dim}")
        ids = self.target_layer_ids
        if (not isinstance(ids, tuple) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.target_num_hidden_layers):
            raise ValueError(f"DSpark config: target_layer_ids: expected distinct ascending layer indices in 0.."
                             f"{self.target_num_hidden_layers - 1} (target_num_hidden_layers="
                             f"{self.target_num_hidden_layers}), got {ids!r}")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"DSpark config: mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"(vocab_size {self.vocab_size})")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"DSpark config: rms_norm_eps: expected a number in (0, 1), got {eps!r}")
        if not isinstance(self.rope, YarnRope):
            raise ValueError(f"DSpark config: rope: expected a YarnRope, got {type(self.rope).__name__}")

    @classmethod
    def from_dict(cls, raw: Any) -> DSparkConfig:
        """From a config.json object; ValueError naming a missing key or a setting this drafter does not run."""
        if not isinstance(raw, dict):
            raise ValueError(f"DSpark config: expected a JSON object, got {type(raw).__name__}")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"DSpark config: missing keys {missing}")
        checks = {"mla_use_nope": False, "mla_use_output_gate": False, "markov_head_type": "vanilla",
                  "hidden_act": "silu", "num_key_value_heads": raw["num_attention_heads"],
                  "draft_vocab_size": raw["vocab_size"]}
        for key, want in checks.items():
            if key in raw and raw[key] != want:
                raise ValueError(f"DSpark config: {key}={raw[key]!r} is not supported (rocm-k3 runs the released "
                                 f"layout: {key}={want!r})")
        taps = raw["target_layer_ids"]
        if "num_target_layers" in raw and isinstance(taps, list) and raw["num_target_layers"] != len(taps):
            raise ValueError(f"DSpark config: num_target_layers={raw['num_target_layers']!r}, but target_layer_ids "
                             f"{taps} names {len(taps)} layers")
        return cls(**{k: raw[k] for k in _INTS}, target_layer_ids=tuple(taps) if isinstance(taps, list) else taps,
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope=YarnRope.from_config(raw))

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def tensor_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter loads, by checkpoint name, with its shape (see the module docstring)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "context_proj.weight": (h, len(cfg.target_layer_ids) * cfg.target_hidden_size),
        "context_norm.weight": (h,),
        "final_norm.weight": (h,),
        "markov_head.markov_w1.weight": (cfg.vocab_size, cfg.markov_rank),
        "markov_head.markov_w2.weight": (cfg.vocab_size, cfg.markov_rank),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (cfg.q_lora_rank, h),
            p + "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (n * cfg.q_head_dim, cfg.q_lora_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            p + "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            p + "self_attn.o_proj.weight": (h, n * cfg.v_head_dim),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
    return shapes


def is_dspark_config(raw: Any) -> bool:
    """Whether a config.json object names a K3 DSpark drafter."""
    if not isinstance(raw, dict):
        return False
    arch = raw.get("architectures")
    return raw.get("model_type") == MODEL_TYPE or (isinstance(arch, list) and ARCHITECTURE in arch)
