"""Model configuration: validated dataclasses built from a Hugging Face ``config.json``.

Two layouts are accepted (K3_SPEC section 1):
- Kimi K3: top level ``model_type: kimi_k3`` with the language model under ``text_config``
  (``model_type: kimi_linear``) and a vision tower under ``vision_config`` (ignored by the text model);
- Kimi Linear: a plain ``model_type: kimi_linear`` config.

Layer lists in the HF config are 1-based; they are converted to 0-based exactly once, here. Every check raises
:class:`ConfigError` (a ``ValueError``) naming the field, the expected and the given value. The JSON type of
every key that is read is checked in one place, against :data:`TEXT_CONFIG_TYPES` / :data:`LINEAR_ATTN_TYPES`,
before any value is used (``"2"`` is not 2, ``"false"`` is not False, NaN and infinities are not numbers); the
ranges are checked by the dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rocm_k3 import checkpoint_io

SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")

# The released MLA latent geometry (both K3 and Kimi Linear): 512 c_kv + 64 k_pe per cached token, 128 nope +
# 64 rope query dims and 128 value dims per head. Only defaults for a config that omits the keys: the model, the
# ops and the cache take the widths from the config and the tensor shapes.
MLA_KV_LORA_RANK = 512
MLA_QK_NOPE_HEAD_DIM = 128
MLA_QK_ROPE_HEAD_DIM = 64
MLA_V_HEAD_DIM = 128
# q_a_layernorm / kv_a_layernorm: transformers' Kimi Linear (KimiLinearRMSNorm(q_lora_rank / kv_lora_rank)) and
# Moonshot's modeling code build them with the RMSNorm default eps 1e-6, whatever rms_norm_eps says (every other
# norm uses rms_norm_eps). tests/model/test_mla_geometry.py checks this against transformers with rms_norm_eps = 0.1.
MLA_NORM_EPS = 1e-6
MAX_LAYERS = 4096  # a sane bound (K3: 93): layer counts drive Python loops over range(num_hidden_layers)


class ConfigError(ValueError):
    """A ``config.json`` that rocm-k3 cannot serve; the message names the field."""


class UnsupportedModelError(ConfigError):
    """``model_type`` (or architecture feature) that is not a Kimi K3 / Kimi Linear language model."""


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention geometry (``linear_attn_config``).

    num_heads / head_dim: H and D (K = V = D). conv_kernel_size: W of the short causal conv.
    gate_lower_bound: L of the K3 safe gate ``g = L * sigmoid(...)``; None = Kimi Linear softplus gate.
    full_rank_gate: output gate ``g_proj: hidden -> H*D`` (K3) instead of ``g_b(g_a(x))`` through rank D.
    """

    num_heads: int
    head_dim: int
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    full_rank_gate: bool = False

    def __post_init__(self) -> None:
        _positive("linear_attn_config.num_heads", self.num_heads)
        _positive("linear_attn_config.head_dim", self.head_dim)
        if not isinstance(self.conv_kernel_size, int) or self.conv_kernel_size < 2:
            raise ConfigError(
                f"linear_attn_config.short_conv_kernel_size: expected an int >= 2, got {self.conv_kernel_size!r}"
            )
        if self.gate_lower_bound is not None and not (math.isfinite(self.gate_lower_bound)
                                                       and self.gate_lower_bound < 0):
            raise ConfigError(
                f"linear_attn_config.gate_lower_bound: expected a finite negative number or null, got "
                f"{self.gate_lower_bound!r}"
            )

    @property
    def proj_dim(self) -> int:
        """H * D: width of each of q, k, v, the output gate and the decay-gate input."""
        return self.num_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The text model of Kimi K3 or Kimi Linear. Layer indices are 0-based.

    ``mla_layers`` / ``kda_layers`` partition ``range(num_hidden_layers)``. ``weight_prefix`` is the checkpoint
    name prefix of the text model (``"language_model."`` for K3, ``""`` for Kimi Linear). ``expert_format`` is
    ``"mxfp4"`` (compressed-tensors ``mxfp4-pack-quantized`` routed experts) or ``"bf16"``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    kda: KDAConfig  # linear_attn_config: the KDA layers' geometry
    mla_layers: tuple[int, ...]  # linear_attn_config.full_attn_layers
    kda_layers: tuple[int, ...]  # every other layer
    num_attention_heads: int
    kv_lora_rank: int = MLA_KV_LORA_RANK
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = MLA_QK_NOPE_HEAD_DIM
    qk_rope_head_dim: int = MLA_QK_ROPE_HEAD_DIM
    v_head_dim: int = MLA_V_HEAD_DIM
    mla_use_output_gate: bool = False  # attention output times sigmoid(g_proj(x)) before o_proj
    num_experts: int = 0  # routed experts of each MoE layer
    num_experts_per_token: int = 0  # the top-k (config.json may say num_experts_per_tok)
    num_shared_experts: int = 0  # experts every token runs besides its top-k
    moe_intermediate_size: int = 0  # N of one routed expert (w13 [2N, K], w2 [Kout, N])
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    hidden_act: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    attn_res_block_size: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    expert_format: str = "bf16"
    weight_prefix: str = ""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            _positive(name, getattr(self, name))
        self._check_layers()
        self._check_mla()
        self._check_moe()
        if self.hidden_act not in ("silu", "situ"):
            raise ConfigError(f"hidden_act: expected 'silu' or 'situ', got {self.hidden_act!r}")
        if self.attn_res_block_size is not None:
            _positive("attn_res_block_size", self.attn_res_block_size)
        for key, value in (("rms_norm_eps", self.rms_norm_eps), ("routed_scaling_factor", self.routed_scaling_factor),
                           ("activation_situ_beta", self.situ_beta),
                           ("activation_situ_linear_beta", self.situ_linear_beta)):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{key}: expected a finite number > 0, got {value!r}")
        if self.expert_format not in ("mxfp4", "bf16"):
            raise ConfigError(f"expert_format: expected 'mxfp4' or 'bf16', got {self.expert_format!r}")
        for tok in ((self.bos_token_id,) if self.bos_token_id is not None else ()) + self.eos_token_id:
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"bos/eos token id {tok} is outside the vocabulary [0, {self.vocab_size})")

    def _check_layers(self) -> None:
        n = _layer_count(self.num_hidden_layers)
        for name in ("mla_layers", "kda_layers"):
            layers = getattr(self, name)
            bad = [i for i in layers if not 0 <= i < n]
            if bad:
                raise ConfigError(
                    f"linear_attn_config.{'full_attn_layers' if name == 'mla_layers' else 'kda_layers'}: "
                    f"layers {[i + 1 for i in bad]} (1-based) are outside 1..{n}"
                )
            if len(set(layers)) != len(layers):
                raise ConfigError(f"{name}: repeated layer indices in {[i + 1 for i in layers]} (1-based)")
        both = sorted(set(self.mla_layers) & set(self.kda_layers))
        if both:
            raise ConfigError(f"layers {[i + 1 for i in both]} (1-based) are listed as both MLA and KDA layers")
        missing = sorted(set(range(n)) - set(self.mla_layers) - set(self.kda_layers))
        if missing:
            raise ConfigError(f"layers {[i + 1 for i in missing]} (1-based) are neither MLA nor KDA layers")

    def _check_mla(self) -> None:
        """Any latent geometry: the ops take their widths from the tensor shapes (kernels decline what they
        cannot run through ``supports``)."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)

    def _check_moe(self) -> None:
        n_moe = self.num_hidden_layers - self.first_k_dense_replace
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace: expected 0..{self.num_hidden_layers}, got {self.first_k_dense_replace}"
            )
        if self.first_k_dense_replace > 0:
            _positive("intermediate_size", self.intermediate_size)
        if n_moe > 0:
            _positive("num_experts", self.num_experts)
            _positive("moe_intermediate_size", self.moe_intermediate_size)
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_token: expected 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_token}"
                )
            if self.num_shared_experts < 0:
                raise ConfigError(f"num_shared_experts: expected >= 0, got {self.num_shared_experts}")
            if self.routed_expert_hidden_size is not None:
                _positive("routed_expert_hidden_size", self.routed_expert_hidden_size)
            if self.expert_format == "mxfp4":
                for name, dim in (("expert input dim", self.expert_hidden_size),
                                  ("moe_intermediate_size", self.moe_intermediate_size)):
                    if dim % 32:
                        raise ConfigError(f"{name}: MXFP4 experts need a multiple of 32, got {dim}")

    # ------------------------------------------------------------------ derived
    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def num_attn_res_blocks(self) -> int:
        """Snapshots written over the stack: one at every layer l with l % B == 0 (b_0 = the embedding)."""
        if self.attn_res_block_size is None:
            return 0
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def expert_hidden_size(self) -> int:
        """Input/output width of a routed expert: the latent width with LatentMoE, else hidden_size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_width(self) -> int:
        """Values cached per token per MLA layer: the normalised c_kv (kv_lora_rank) then k_pe (rope dims)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_mla_layer(self, layer: int) -> bool:
        return layer in self._mla_set

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def _mla_set(self) -> frozenset[int]:
        return frozenset(self.mla_layers)

    def layer_slot(self, layer: int) -> int:
        """Index of ``layer`` among the layers of its kind (the cache's mla / kda layer index)."""
        kind = self.mla_layers if self.is_mla_layer(layer) else self.kda_layers
        return sorted(kind).index(layer)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json`` (K3 top-level or plain Kimi Linear)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config.json: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError("kimi_k3 config: expected a 'text_config' object")
            if text.get("model_type", "kimi_linear") != "kimi_linear":
                raise UnsupportedModelError(
                    f"text_config.model_type: expected 'kimi_linear', got {text.get('model_type')!r}"
                )
            quant = raw.get("quantization_config", text.get("quantization_config"))
            return _from_text_config("kimi_k3", text, quant, weight_prefix="language_model.")
        if model_type == "kimi_linear":
            return _from_text_config("kimi_linear", raw, raw.get("quantization_config"), weight_prefix="")
        raise UnsupportedModelError(
            f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory."""
        return cls.from_hf_dict(read_config_json(path))


def read_config_json(path: str | Path) -> Any:
    """The parsed ``config.json`` of a checkpoint directory, read as untrusted input (FileNotFoundError when
    absent; ConfigError for a non-regular file, invalid UTF-8 or JSON, naming the file)."""
    file = checkpoint_io.member(Path(path), "config.json")
    if not checkpoint_io.require_regular(file, ConfigError):
        raise FileNotFoundError(f"no config.json in {path}")
    return checkpoint_io.read_json(file, ConfigError)


# ------------------------------------------------------------------------------------------ value types
# The JSON type of every key read from ``text_config`` (or a plain Kimi Linear config) and from its
# ``linear_attn_config``. A "?" kind also accepts null; for every key null counts as absent (the default).
TEXT_CONFIG_TYPES: dict[str, str] = {
    "vocab_size": "int", "hidden_size": "int", "num_hidden_layers": "int", "num_attention_heads": "int",
    "kv_lora_rank": "int", "q_lora_rank": "int?", "qk_nope_head_dim": "int", "qk_rope_head_dim": "int",
    "v_head_dim": "int", "mla_use_nope": "bool", "mla_use_output_gate": "bool",
    "num_experts": "int", "num_local_experts": "int", "n_routed_experts": "int",
    "num_experts_per_token": "int", "num_experts_per_tok": "int", "num_shared_experts": "int",
    "n_shared_experts": "int", "moe_intermediate_size": "int", "routed_expert_hidden_size": "int?",
    "latent_moe_use_norm": "bool", "first_k_dense_replace": "int", "moe_layer_freq": "int",
    "intermediate_size": "int", "moe_router_activation_func": "str", "topk_method": "str",
    "num_expert_group": "int", "n_group": "int", "topk_group": "int", "routed_scaling_factor": "number",
    "moe_renormalize": "bool", "norm_topk_prob": "bool", "hidden_act": "str", "activation_situ_beta": "number",
    "activation_situ_linear_beta": "number?", "attn_res_block_size": "int?", "rms_norm_eps": "number",
    "max_position_embeddings": "int", "model_max_length": "int", "tie_word_embeddings": "bool",
    "bos_token_id": "int?", "eos_token_id": "token_ids", "linear_attn_config": "object",
    "layer_types": "str_list", "mlp_layer_types": "str_list", "linear_num_heads": "int", "linear_head_dim": "int",
    "linear_conv_kernel_dim": "int",
}
LINEAR_ATTN_TYPES: dict[str, str] = {
    "num_heads": "int", "head_dim": "int", "short_conv_kernel_size": "int", "gate_lower_bound": "number?",
    "use_full_rank_gate": "bool", "full_attn_layers": "layers", "kda_layers": "layers",
}
_EXPECTED = {
    "int": "an integer", "number": "a number", "bool": "true or false", "str": "a string", "object": "an object",
    "token_ids": "an integer or a list of integers", "str_list": "a list of strings",
    "layers": "a list of 1-based layer numbers",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(raw: Mapping[str, Any], table: Mapping[str, str], prefix: str = "") -> dict[str, Any]:
    """A copy of ``raw`` whose keys in ``table`` hold values of their kind (numbers become floats).

    Raises ConfigError naming ``prefix + key``, the expected kind and the value with its JSON type.
    """
    out = dict(raw)
    for key, kind in table.items():
        value = raw.get(key)
        if value is None:
            continue
        base = kind.rstrip("?")
        if base == "int":
            ok = _is_int(value)
        elif base == "number":
            ok = _is_int(value) or isinstance(value, float)
            if ok:
                try:
                    value = float(value)
                except OverflowError:  # an int beyond float range
                    value = math.inf
                if not math.isfinite(value):
                    raise ConfigError(f"{prefix}{key}: expected a finite number, got {raw[key]!r}")
        elif base == "bool":
            ok = isinstance(value, bool)
        elif base == "str":
            ok = isinstance(value, str)
        elif base == "object":
            ok = isinstance(value, Mapping)
        elif base == "token_ids":
            ok = _is_int(value) or (isinstance(value, list) and all(_is_int(v) for v in value))
        elif base == "str_list":
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:  # layers
            ok = isinstance(value, list) and all(_is_int(v) for v in value)
        if not ok:
            null = " or null" if kind.endswith("?") else ""
            raise ConfigError(
                f"{prefix}{key}: expected {_EXPECTED[base]}{null}, got {value!r} ({type(value).__name__})"
            )
        out[key] = value
    return out


def _from_text_config(model_type: str, raw: Mapping[str, Any], quant: Any, weight_prefix: str) -> ModelConfig:
    t = _typed(raw, TEXT_CONFIG_TYPES)

    def get(name: str, default: Any = None, *aliases: str) -> Any:
        for key in (name, *aliases):
            if key in t and t[key] is not None:
                return t[key]
        return default

    n_layers = _int_field("num_hidden_layers", get("num_hidden_layers"))
    _layer_count(n_layers)
    lin = _typed(t.get("linear_attn_config") or {}, LINEAR_ATTN_TYPES, "linear_attn_config.")
    kda = KDAConfig(
        num_heads=_int_field("linear_attn_config.num_heads", lin.get("num_heads", t.get("linear_num_heads"))),
        head_dim=_int_field("linear_attn_config.head_dim", lin.get("head_dim", t.get("linear_head_dim"))),
        conv_kernel_size=lin.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4)),
        gate_lower_bound=lin.get("gate_lower_bound"),
        full_rank_gate=lin.get("use_full_rank_gate") or False,
    )
    if "full_attn_layers" in lin:
        mla = _one_based("linear_attn_config.full_attn_layers", lin["full_attn_layers"])
        kda_layers = (_one_based("linear_attn_config.kda_layers", lin["kda_layers"]) if "kda_layers" in lin
                      else tuple(i for i in range(n_layers) if i not in mla))
    elif isinstance(t.get("layer_types"), list):  # transformers' expanded form
        types = t["layer_types"]
        if len(types) != n_layers:
            raise ConfigError(f"layer_types: expected {n_layers} entries, got {len(types)}")
        mla = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
        kda_layers = tuple(i for i, kind in enumerate(types) if kind == "linear_attention")
    else:
        raise ConfigError("linear_attn_config.full_attn_layers: required (which layers are MLA)")

    if get("mla_use_nope", True) is not True:
        raise UnsupportedModelError("mla_use_nope: rocm-k3 serves the NoPE MLA of Kimi K3 / Kimi Linear only")
    router = get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise UnsupportedModelError(f"moe_router_activation_func: expected 'sigmoid', got {router!r}")
    groups = get("num_expert_group", 1, "n_group")
    if groups != 1 or get("topk_group", 1) != 1:
        raise UnsupportedModelError(
            f"num_expert_group / topk_group: expected 1 / 1 (noaux_tc with one group), got {groups} / "
            f"{get('topk_group', 1)}"
        )
    if get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(f"moe_layer_freq: expected 1, got {get('moe_layer_freq')}")
    first_dense = get("first_k_dense_replace", None)
    if first_dense is None and isinstance(t.get("mlp_layer_types"), list):
        kinds = t["mlp_layer_types"]
        first_dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
    eos = get("eos_token_id", ())
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if _is_int(eos) else ()
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int_field("vocab_size", get("vocab_size")),
        hidden_size=_int_field("hidden_size", get("hidden_size")),
        num_hidden_layers=n_layers,
        kda=kda,
        mla_layers=mla,
        kda_layers=kda_layers,
        num_attention_heads=_int_field("num_attention_heads", get("num_attention_heads")),
        kv_lora_rank=get("kv_lora_rank", MLA_KV_LORA_RANK),
        q_lora_rank=get("q_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim", MLA_QK_NOPE_HEAD_DIM),
        qk_rope_head_dim=get("qk_rope_head_dim", MLA_QK_ROPE_HEAD_DIM),
        v_head_dim=get("v_head_dim", MLA_V_HEAD_DIM),
        mla_use_output_gate=get("mla_use_output_gate", False),
        num_experts=get("num_experts", 0, "num_local_experts", "n_routed_experts"),
        num_experts_per_token=get("num_experts_per_token", 0, "num_experts_per_tok"),
        num_shared_experts=get("num_shared_experts", 0, "n_shared_experts"),
        moe_intermediate_size=get("moe_intermediate_size", 0),
        routed_expert_hidden_size=get("routed_expert_hidden_size"),
        latent_moe_use_norm=get("latent_moe_use_norm", True),
        first_k_dense_replace=first_dense if first_dense is not None else 1,
        intermediate_size=get("intermediate_size", 0),
        routed_scaling_factor=get("routed_scaling_factor", 1.0),
        moe_renormalize=get("moe_renormalize", True, "norm_topk_prob"),
        hidden_act=get("hidden_act", "silu"),
        situ_beta=get("activation_situ_beta", 4.0),
        situ_linear_beta=t.get("activation_situ_linear_beta", 25.0),
        attn_res_block_size=get("attn_res_block_size"),
        rms_norm_eps=get("rms_norm_eps", 1e-5),
        max_position_embeddings=get("max_position_embeddings", 1048576, "model_max_length"),
        tie_word_embeddings=get("tie_word_embeddings", False),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos_ids,
        expert_format=parse_expert_format(quant),
        weight_prefix=weight_prefix,
    )


def parse_expert_format(quant: Any) -> str:
    """``"mxfp4"`` for a compressed-tensors mxfp4-pack-quantized config, ``"bf16"`` when unquantised."""
    if quant is None:
        return "bf16"
    if not isinstance(quant, Mapping):
        raise ConfigError(f"quantization_config: expected an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"quantization_config.quant_method: expected 'compressed-tensors', got {method!r}")
    formats = {quant.get("format")}
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ConfigError(f"quantization_config.config_groups: expected an object, got {type(groups).__name__}")
    for key, group in groups.items():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights") or {}, Mapping):
            raise ConfigError(f"quantization_config.config_groups.{key}: expected an object with a 'weights' object")
        formats.add(group.get("format"))
        weights = group.get("weights") or {}
        if weights.get("num_bits", 4) != 4 or weights.get("group_size", 32) != 32:
            raise ConfigError(
                f"quantization_config: expected 4-bit weights in groups of 32 (MXFP4), got num_bits="
                f"{weights.get('num_bits')}, group_size={weights.get('group_size')}"
            )
    formats.discard(None)
    if formats != {"mxfp4-pack-quantized"}:
        raise ConfigError(
            f"quantization_config.format: expected 'mxfp4-pack-quantized', got {sorted(map(repr, formats))}"
        )
    return "mxfp4"


def _one_based(name: str, layers: Any) -> tuple[int, ...]:
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) for i in layers):
        raise ConfigError(f"{name}: expected a list of 1-based layer numbers, got {layers!r}")
    if any(i < 1 for i in layers):
        raise ConfigError(f"{name}: layer numbers are 1-based, got {sorted(i for i in layers if i < 1)}")
    return tuple(i - 1 for i in layers)


def _layer_count(n: int) -> int:
    if n > MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers: expected at most {MAX_LAYERS}, got {n}")
    return n


def _int_field(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    return value


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
