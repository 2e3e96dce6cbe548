"""A tiny seeded K3-variant vision tower + projector for the embedded tiny K3 (``rocm-k3 make-tiny --vision``).

Every K3 feature is present at small widths: RMSNorm without biases, an attention wider than the residual stream
(qkv 48 for a 32-wide stream: 2 heads of 24), bilinear position-table interpolation (an 8 x 8 table), the 2 x 2
``sd2_tpool`` merge and the ``patchmergerv2`` projector with its post-norm, into the LM's hidden size. The
preprocessor limits are lowered (at most 32 x 32 = 1024 patches, 256 tokens an image) so image prompts stay cheap
on a CPU. The weights are random: the tower exercises the code paths, it does not see.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rocm_k3.model.vision.config import K3_VISION_CONFIG, VisionConfig
from rocm_k3.model.vision.model import expected_vision_tensors

TINY_VISION_OVERRIDES: dict[str, Any] = {
    "vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
    "qkv_hidden_size": 48, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "mm_hidden_size": 32,
}
TINY_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 1024,
                       "patch_limit_on_one_side": 32, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                       "fixed_output_tokens": None},
}


def tiny_vision_config(text_hidden_size: int) -> dict[str, Any]:
    """The ``vision_config`` object of the tiny tower (the released K3 one at small widths)."""
    return {**K3_VISION_CONFIG, **TINY_VISION_OVERRIDES, "text_hidden_size": text_hidden_size}


def seeded_vision_tensors(cfg: VisionConfig, seed: int, bias_scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Checkpoint name -> seeded fp32 tensor for every tensor ``cfg`` implies.

    Linear and conv weights ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.1^2); biases ~ N(0, bias_scale^2); the
    position table ~ N(0, 0.5^2) (large enough that its interpolation shows in the output).
    """
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_vision_tensors(cfg).items():
        noise = torch.randn(shape, generator=gen)
        module, kind = name.rsplit(".", 2)[-2:]
        if "norm" in module and kind == "weight":  # norm0 / norm1 / final_layernorm / pre_norm / post_norm
            tensors[name] = 1.0 + 0.1 * noise
        elif kind == "bias":
            tensors[name] = bias_scale * noise
        elif name.endswith("pos_emb.weight"):
            tensors[name] = 0.5 * noise
        else:
            tensors[name] = noise / math.sqrt(math.prod(shape[1:]))
    return tensors


def tiny_vision_tensors_and_config(text_hidden_size: int, seed: int = 0) -> tuple[dict[str, torch.Tensor],
                                                                                   dict[str, Any]]:
    """(checkpoint name -> fp32 tensor, ``vision_config``) of the tiny tower for an LM of ``text_hidden_size``."""
    raw = tiny_vision_config(text_hidden_size)
    return seeded_vision_tensors(VisionConfig.from_hf_dict(raw), seed), raw
