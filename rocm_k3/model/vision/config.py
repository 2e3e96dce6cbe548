"""The vision tower's configuration: a validated dataclass built from a checkpoint's ``vision_config``.

Two released variants (SERVING_SPEC section 6), told apart by the fields themselves, never by a model name:

- **K3 "MoonViT-V2"**: ``norm_type: rmsnorm``, no biases (``attn_bias`` / ``linear_bias`` /
  ``patch_embed_proj_bias`` false), attention wider than the residual stream (``qkv_hidden_size`` 1536 for a
  1024 stream, 12 heads of 128), bilinear position-table interpolation, ``mm_projector_type: patchmergerv2``
  (no pre-norm, bias-free linears, RMSNorm after the projection).
- **K2.5 MoonViT**: LayerNorm with biases everywhere, qkv width = hidden (16 heads of 72), bicubic
  interpolation, ``mm_projector_type: patchmerger`` (LayerNorm per patch first, linears with biases).

Keys absent from ``vision_config`` take the K2.5 / MoonViT defaults (layernorm, biases on, qkv = hidden,
bicubic, patchmerger): the K2.5 release omits them, and vLLM and transformers use the same defaults. Both the
released names (``vt_hidden_size``, ``init_pos_emb_height``, ...) and transformers' names (``hidden_size``,
``pos_emb_height``, ...) are read.

**Tower norm epsilon.** No release writes one. transformers' K2.5 model (and vLLM's ``nn.LayerNorm(dim)``) use
1e-5 for the LayerNorms. For the K3 RMSNorms vLLM builds ``nn.RMSNorm(dim)`` (``eps=None``) and xLLM uses
``finfo(dtype).eps``: the eps is the machine epsilon of the activation dtype (2^-7 in bf16, 2^-23 in fp32),
SERVING_SPEC 6.2 [INF, medium]. ``norm_eps = None`` means exactly that; an explicit ``norm_eps`` key overrides it.
The projector's norms use ``projector_ln_eps`` (1e-5).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from rocm_k3.model.config import ConfigError, UnsupportedModelError

NORM_TYPES = ("layernorm", "rmsnorm")
PROJECTOR_TYPES = ("patchmerger", "patchmergerv2")
INTERPOLATION_MODES = ("bilinear", "bicubic")
ACTIVATIONS = ("gelu_pytorch_tanh",)  # the tower MLP's activation (GELU, tanh approximation)
LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default: transformers' K2.5 tower and vLLM's MoonViT
ROPE_MAX_GRID = 512  # the released 2-D RoPE table is 512 x 512 positions (= patch_limit_on_one_side)


class VisionConfigError(ConfigError):
    """A ``vision_config`` that rocm-k3 cannot serve; the message names the field."""


class UnsupportedVisionError(VisionConfigError, UnsupportedModelError):
    """A tower feature (norm, projector, merge, position table type) that rocm-k3 does not implement."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT tower + projector geometry (names follow the released ``vision_config``).

    hidden_size (``vt_hidden_size``) is the residual stream D; qkv_hidden_size the attention width
    (num_attention_heads * head_dim; = D in K2.5). pos_emb_height / pos_emb_width: the learnable table
    ``[H0, W0, D]`` interpolated per image; pos_emb_time: frames of the fixed time table (images use t = 1 only).
    merge_kernel_size (kh, kw): the patch merger's neighbourhood. text_hidden_size: the LM hidden size the projector
    maps to. norm_eps: tower norm epsilon, None = ``finfo(activation dtype).eps`` (module docstring).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    qkv_hidden_size: int
    text_hidden_size: int
    norm_type: str
    attn_bias: bool
    linear_bias: bool
    patch_embed_proj_bias: bool
    pos_emb_interpolation_mode: str
    projector_type: str
    norm_eps: float | None
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    activation: str = "gelu_pytorch_tanh"
    projector_ln_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "qkv_hidden_size", "text_hidden_size", "patch_size", "pos_emb_height", "pos_emb_width",
                     "pos_emb_time"):
            _positive(name, getattr(self, name))
        if self.qkv_hidden_size % self.num_attention_heads:
            raise VisionConfigError(
                f"qkv_hidden_size: {self.qkv_hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.head_dim % 4:
            raise VisionConfigError(
                f"head_dim = qkv_hidden_size / num_attention_heads = {self.head_dim}: the 2-D RoPE needs a multiple "
                "of 4 (one x and one y rotation pair per frequency)"
            )
        kernel = self.merge_kernel_size
        if (not isinstance(kernel, tuple) or len(kernel) != 2 or
                not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in kernel)):
            raise VisionConfigError(f"merge_kernel_size: expected two positive integers, got {kernel!r}")
        _choice("norm_type", self.norm_type, NORM_TYPES)
        _choice("mm_projector_type", self.projector_type, PROJECTOR_TYPES)
        _choice("pos_emb_interpolation_mode", self.pos_emb_interpolation_mode, INTERPOLATION_MODES)
        _choice("activation_func", self.activation, ACTIVATIONS)
        for name in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise VisionConfigError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if self.norm_eps is not None:
            _positive_float("norm_eps", self.norm_eps)
        _positive_float("projector_ln_eps", self.projector_ln_eps)
        _positive_float("rope_theta", self.rope_theta)

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        """Patches per output token (kh * kw = 4)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_hidden_size(self) -> int:
        """The projector's input width: kh * kw * D."""
        return self.merge_area * self.hidden_size

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 * patch_size^2 (588)."""
        return 3 * self.patch_size * self.patch_size

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], text_hidden_size: int | None = None) -> VisionConfig:
        """Build from a checkpoint's ``vision_config`` object.

        ``text_hidden_size``: the language model's hidden size (``text_config.hidden_size``); required when
        ``vision_config`` has no ``text_hidden_size``, and must agree with it when both are given.
        """
        if not isinstance(raw, Mapping):
            raise VisionConfigError(f"vision_config: expected a JSON object, got {type(raw).__name__}")

        def get(default: Any, *keys: str) -> Any:
            for key in keys:
                if raw.get(key) is not None:
                    return raw[key]
            return default

        _expect(raw, "merge_type", "sd2_tpool")
        _expect(raw, "pos_emb_type", "divided_fixed")
        _expect(raw, "mlp_type", "mlp2")
        _expect(raw, "video_attn_type", "spatial_temporal")
        _expect(raw, "projector_hidden_act", "gelu")
        hidden = get(None, "vt_hidden_size", "hidden_size")
        mm_hidden = raw.get("mm_hidden_size")
        if mm_hidden is not None and mm_hidden != hidden:
            raise VisionConfigError(
                f"mm_hidden_size: expected the tower width vt_hidden_size = {hidden}, got {mm_hidden!r}"
            )
        text = raw.get("text_hidden_size")
        if text is not None and text_hidden_size is not None and text != text_hidden_size:
            raise VisionConfigError(
                f"vision_config.text_hidden_size {text!r} disagrees with the language model's hidden size "
                f"{text_hidden_size}"
            )
        text = text if text is not None else text_hidden_size
        if text is None:
            raise VisionConfigError("vision_config.text_hidden_size: required (or pass the LM hidden size)")
        norm_type = get("layernorm", "norm_type")
        kernel = get([2, 2], "merge_kernel_size")
        return cls(
            hidden_size=hidden,
            intermediate_size=get(None, "vt_intermediate_size", "intermediate_size"),
            num_hidden_layers=get(None, "vt_num_hidden_layers", "num_hidden_layers"),
            num_attention_heads=get(None, "vt_num_attention_heads", "num_attention_heads"),
            qkv_hidden_size=get(hidden, "qkv_hidden_size"),
            text_hidden_size=text,
            norm_type=norm_type,
            attn_bias=get(True, "attn_bias"),
            linear_bias=get(True, "linear_bias"),
            patch_embed_proj_bias=get(True, "patch_embed_proj_bias"),
            pos_emb_interpolation_mode=get("bicubic", "pos_emb_interpolation_mode"),
            projector_type=get("patchmerger", "mm_projector_type"),
            norm_eps=get(LAYERNORM_EPS if norm_type == "layernorm" else None, "norm_eps"),
            patch_size=get(14, "patch_size"),
            pos_emb_height=get(64, "init_pos_emb_height", "pos_emb_height"),
            pos_emb_width=get(64, "init_pos_emb_width", "pos_emb_width"),
            pos_emb_time=get(4, "init_pos_emb_time", "pos_emb_time"),
            merge_kernel_size=tuple(kernel) if isinstance(kernel, (list, tuple)) else kernel,
            activation=get("gelu_pytorch_tanh", "activation_func", "hidden_act"),
            projector_ln_eps=float(get(1e-5, "projector_ln_eps", "projection_layer_norm_eps")),
            rope_theta=float(get(10000.0, "rope_theta")),
        )

    @classmethod
    def from_checkpoint_config(cls, raw: Mapping[str, Any]) -> VisionConfig | None:
        """The tower of a top-level ``config.json`` (K3 / K2.5), or None when it has no ``vision_config``."""
        if not isinstance(raw, Mapping):
            raise VisionConfigError(f"config.json: expected a JSON object, got {type(raw).__name__}")
        vision = raw.get("vision_config")
        if vision is None:
            return None
        text = raw.get("text_config") or {}
        return cls.from_hf_dict(vision, text.get("hidden_size") if isinstance(text, Mapping) else None)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VisionConfigError(f"vision_config.{name}: expected a positive integer, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise VisionConfigError(f"vision_config.{name}: expected a finite positive number, got {value!r}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UnsupportedVisionError(f"vision_config.{name}: expected one of {choices}, got {value!r}")


def _expect(raw: Mapping[str, Any], key: str, value: str) -> None:
    if raw.get(key) is not None and raw[key] != value:
        raise UnsupportedVisionError(f"vision_config.{key}: rocm-k3 serves {value!r} only, got {raw[key]!r}")


# The released vision_config objects (SERVING_SPEC 6.1), as config.json writes them.
K3_VISION_CONFIG: dict[str, Any] = {
    "patch_size": 14, "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "vt_num_hidden_layers": 27,
    "vt_num_attention_heads": 12, "qkv_hidden_size": 1536, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
    "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": 1024, "text_hidden_size": 7168, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
    "norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "linear_bias": False, "patch_embed_proj_bias": False,
}
K25_VISION_CONFIG: dict[str, Any] = {
    "patch_size": 14, "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 27,
    "vt_num_attention_heads": 16, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger", "mm_hidden_size": 1152, "text_hidden_size": 7168,
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "video_attn_type": "spatial_temporal",
}
