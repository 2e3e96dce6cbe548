"""The released checkpoint layouts: every tensor name, shape and storage kind a config implies.

Names are the Hugging Face ones. Kimi Linear (as ``transformers`` writes it): ``model.embed_tokens.weight``,
``model.layers.N.*``, ``model.norm.weight``, ``lm_head.weight``. Kimi K3 puts the same text-model names under
``language_model.`` (``language_model.model.layers.N.*``, ``language_model.lm_head.weight``) next to the vision
tower (``vision_tower.*``, ``mm_projector.*``, not used by the text model). Inside a layer (K3_SPEC section 9):

- KDA: ``self_attn.{q,k,v}_proj``, ``self_attn.{q,k,v}_conv1d`` ``[H*D, 1, W]``, ``self_attn.f_a_proj``,
  ``self_attn.f_b_proj``, ``self_attn.b_proj``, output gate ``self_attn.g_proj`` (K3, full rank) or
  ``self_attn.g_a_proj`` / ``self_attn.g_b_proj`` (Kimi Linear), ``self_attn.A_log`` fp32 (``[1, 1, H, 1]`` from transformers, ``[D]`` zero-padded in K3),
  ``self_attn.dt_bias`` ``[H*D]`` fp32, ``self_attn.o_norm``, ``self_attn.o_proj``.
- MLA: ``self_attn.q_proj`` or ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
  ``self_attn.kv_a_proj_with_mqa``, ``self_attn.kv_a_layernorm``, ``self_attn.kv_b_proj``, optional output gate
  ``self_attn.g_proj``, ``self_attn.o_proj``.
- MoE: ``block_sparse_moe.gate.weight``, ``block_sparse_moe.gate.e_score_correction_bias``,
  ``block_sparse_moe.experts.E.w{1,2,3}.weight`` (bf16) or ``.weight_packed`` + ``.weight_scale`` (MXFP4,
  compressed-tensors), ``block_sparse_moe.shared_experts.{gate,up,down}_proj``, LatentMoE
  ``block_sparse_moe.routed_expert_{down_proj,norm,up_proj}``.
- Dense MLP (first ``first_k_dense_replace`` layers): ``mlp.{gate,up,down}_proj`` (K3);
  transformers' Kimi Linear writes the same tensors as ``block_sparse_moe.{gate,up,down}_proj`` (accepted too).
- Norms ``input_layernorm``, ``post_attention_layernorm``; AttnRes ``self_attention_res_{norm,proj}``,
  ``mlp_res_{norm,proj}`` (proj ``[1, hidden]``) and model level ``model.output_attn_res_{norm,proj}``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from rocm_k3.checkpoint_errors import MissingTensorError
from rocm_k3.model.config import ModelConfig

# storage kinds: "float" = any float dtype, cast to the model dtype; "fp32" = kept in float32; "uint8" = raw bytes
KINDS = ("float", "fp32", "uint8")

# checkpoint prefixes that belong to the vision tower of K3 and are skipped by the text model
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")

_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: canonical name (without the K3 ``language_model.`` prefix), shape and kind.

    ``alt_shapes``: other layouts of the same values that releases use (e.g. ``A_log``, see ``_kda_specs``).
    """

    name: str
    shape: tuple[int, ...]
    kind: str = "float"
    alt_shapes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")

    def accepts(self, shape: tuple[int, ...]) -> bool:
        return shape == self.shape or shape in self.alt_shapes


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expected_tensors(cfg: ModelConfig, limit: int | None = None) -> dict[str, TensorSpec]:
    """Every tensor the checkpoint of ``cfg`` must hold, by canonical name.

    ``limit``: a bound derived from the tensors the checkpoint holds. A config that implies more (e.g. a hostile
    ``num_experts`` of 10**9) raises MissingTensorError as soon as the count passes it, instead of listing them all.
    """
    out: dict[str, TensorSpec] = {}
    for spec in _iter_specs(cfg):
        out[spec.name] = spec
        if limit is not None and len(out) > limit:
            raise MissingTensorError(
                f"the config implies more than {limit} tensors ({cfg.num_hidden_layers} layers, {cfg.num_experts} "
                "experts per MoE layer), far more than the checkpoint holds"
            )
    return out


def _iter_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    yield TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    yield TensorSpec("model.norm.weight", (cfg.hidden_size,))
    if not cfg.tie_word_embeddings:
        yield TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    if cfg.uses_attn_res:
        yield TensorSpec("model.output_attn_res_norm.weight", (cfg.hidden_size,))
        yield TensorSpec("model.output_attn_res_proj.weight", (1, cfg.hidden_size))
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        yield TensorSpec(p + "input_layernorm.weight", (cfg.hidden_size,))
        yield TensorSpec(p + "post_attention_layernorm.weight", (cfg.hidden_size,))
        if cfg.uses_attn_res:
            for site in ("self_attention_res", "mlp_res"):
                yield TensorSpec(p + f"{site}_norm.weight", (cfg.hidden_size,))
                yield TensorSpec(p + f"{site}_proj.weight", (1, cfg.hidden_size))
        yield from _mla_specs(cfg, p) if cfg.is_mla_layer(layer) else _kda_specs(cfg, p)
        yield from _moe_specs(cfg, p) if cfg.is_moe_layer(layer) else _dense_specs(cfg, p)


def _kda_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h, d, w, hid = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size, cfg.hidden_size
    a = p + "self_attn."
    specs = [TensorSpec(a + f"{x}_proj.weight", (h * d, hid)) for x in "qkv"]
    specs += [TensorSpec(a + f"{x}_conv1d.weight", (h * d, 1, w)) for x in "qkv"]
    specs += [TensorSpec(a + "f_a_proj.weight", (d, hid)), TensorSpec(a + "f_b_proj.weight", (h * d, d)),
              TensorSpec(a + "b_proj.weight", (h, hid)),
              # A_log: [1, 1, H, 1] as transformers writes it, [H], or (the K3 release) [D] with the H real
              # entries first and zero padding up to head_dim; the model keeps the first H values.
              TensorSpec(a + "A_log", (1, 1, h, 1), "fp32", alt_shapes=((h,), (d,)) if d > h else ((h,),)),
              TensorSpec(a + "dt_bias", (h * d,), "fp32"),
              TensorSpec(a + "o_norm.weight", (d,)), TensorSpec(a + "o_proj.weight", (hid, h * d))]
    if cfg.kda.full_rank_gate:
        specs.append(TensorSpec(a + "g_proj.weight", (h * d, hid)))
    else:
        specs += [TensorSpec(a + "g_a_proj.weight", (d, hid)), TensorSpec(a + "g_b_proj.weight", (h * d, d))]
    return specs


def _mla_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h, hid = cfg.num_attention_heads, cfg.hidden_size
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        specs = [TensorSpec(a + "q_proj.weight", (h * cfg.q_head_dim, hid))]
    else:
        r = cfg.q_lora_rank
        specs = [TensorSpec(a + "q_a_proj.weight", (r, hid)), TensorSpec(a + "q_a_layernorm.weight", (r,)),
                 TensorSpec(a + "q_b_proj.weight", (h * cfg.q_head_dim, r))]
    specs += [
        TensorSpec(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hid)),
        TensorSpec(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        TensorSpec(a + "kv_b_proj.weight", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
        TensorSpec(a + "o_proj.weight", (hid, h * cfg.v_head_dim)),
    ]
    if cfg.mla_use_output_gate:
        specs.append(TensorSpec(a + "g_proj.weight", (h * cfg.v_head_dim, hid)))
    return specs


def _mlp_specs(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inter, hidden)),
            TensorSpec(prefix + "up_proj.weight", (inter, hidden)),
            TensorSpec(prefix + "down_proj.weight", (hidden, inter))]


def _dense_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    return _mlp_specs(p + "mlp.", cfg.hidden_size, cfg.intermediate_size)


def _moe_specs(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    """Generated one by one: ``num_experts`` comes from the (untrusted) config."""
    m = p + "block_sparse_moe."
    hid, e_dim, inter = cfg.hidden_size, cfg.expert_hidden_size, cfg.moe_intermediate_size
    yield TensorSpec(m + "gate.weight", (cfg.num_experts, hid), "fp32")
    yield TensorSpec(m + "gate.e_score_correction_bias", (cfg.num_experts,), "fp32")
    if cfg.num_shared_experts:
        yield from _mlp_specs(m + "shared_experts.", hid, inter * cfg.num_shared_experts)
    if cfg.routed_expert_hidden_size is not None:
        yield TensorSpec(m + "routed_expert_down_proj.weight", (e_dim, hid))
        yield TensorSpec(m + "routed_expert_up_proj.weight", (hid, e_dim))
        if cfg.latent_moe_use_norm:
            yield TensorSpec(m + "routed_expert_norm.weight", (e_dim,))
    for e in range(cfg.num_experts):
        x = f"{m}experts.{e}."
        for w, (out_f, in_f) in (("w1", (inter, e_dim)), ("w3", (inter, e_dim)), ("w2", (e_dim, inter))):
            if cfg.expert_format == "mxfp4":
                yield TensorSpec(x + f"{w}.weight_packed", (out_f, in_f // 2), "uint8")
                yield TensorSpec(x + f"{w}.weight_scale", (out_f, in_f // 32), "uint8")
            else:
                yield TensorSpec(x + f"{w}.weight", (out_f, in_f))


def canonical_name(cfg: ModelConfig, checkpoint_name: str) -> str | None:
    """Map a checkpoint tensor name to its canonical name; None for tensors the text model ignores.

    Strips the K3 ``language_model.`` prefix and maps transformers' dense-MLP spelling
    (``block_sparse_moe.{gate,up,down}_proj`` on a dense layer) to ``mlp.``. Names that do not carry the
    expected prefix are returned unchanged (they will be reported as unexpected).
    """
    if checkpoint_name.startswith(IGNORED_PREFIXES):
        return None
    name = checkpoint_name
    if cfg.weight_prefix and name.startswith(cfg.weight_prefix):
        name = name[len(cfg.weight_prefix):]
    m = _DENSE_ALIAS.match(name)
    if m is not None:
        layer = int(name.split(".")[2])
        if not cfg.is_moe_layer(layer):
            name = m.group(1) + "mlp." + m.group(2)
    return name
