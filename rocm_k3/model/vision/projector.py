"""The projector from merged vision tokens ``[n, kh*kw, D]`` to LM embeddings ``[n, text_hidden]``.

- ``patchmerger`` (K2.5): ``pre_norm`` LayerNorm(D, eps projector_ln_eps) on each of the kh*kw sub-patches,
  flatten to kh*kw*D, ``proj.0`` Linear(kh*kw*D -> kh*kw*D, bias), exact-erf GELU, ``proj.2``
  Linear(-> text_hidden, bias). No post-norm.
- ``patchmergerv2`` (K3): flatten, ``proj.0`` Linear(no bias), exact-erf GELU, ``proj.2`` Linear(no bias), then
  ``post_norm`` RMSNorm(text_hidden, eps projector_ln_eps). No pre-norm.

Parameter names (``pre_norm.*``, ``proj.0.*``, ``proj.2.*``, ``post_norm.weight``) are the checkpoint's under
``mm_projector.``; ``proj.1`` is the parameter-free GELU.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from rocm_k3.model.vision.config import VisionConfig
from rocm_k3.model.vision.layers import VisionNorm, linear


class Projector(nn.Module):
    """``forward(merged [n, kh*kw, D]) -> [n, text_hidden]`` (module docstring)."""

    def __init__(self, cfg: VisionConfig, *, backend: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        width, bias = cfg.merged_hidden_size, cfg.projector_type == "patchmerger"
        if bias:
            self.pre_norm = VisionNorm("layernorm", cfg.hidden_size, cfg.projector_ln_eps, device=device,
                                       dtype=dtype)
        self.proj = nn.Sequential(
            linear(width, width, bias, device, dtype),
            nn.GELU(approximate="none"),
            linear(width, cfg.text_hidden_size, bias, device, dtype),
        )
        if not bias:
            self.post_norm = VisionNorm("rmsnorm", cfg.text_hidden_size, cfg.projector_ln_eps, backend=backend,
                                        device=device, dtype=dtype)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if merged.dim() != 3 or merged.shape[1:] != (cfg.merge_area, cfg.hidden_size):
            raise ValueError(
                f"merged must have shape [n, {cfg.merge_area}, {cfg.hidden_size}], got {list(merged.shape)}"
            )
        x = merged.to(self.proj[0].weight.dtype)
        if cfg.projector_type == "patchmerger":
            x = self.pre_norm(x)  # per sub-patch, over D
        y = self.proj(x.reshape(x.shape[0], cfg.merged_hidden_size))  # [n, text_hidden]
        return self.post_norm(y) if cfg.projector_type == "patchmergerv2" else y
