"""The vision model: the tower (``vision_tower.*``) and the projector (``mm_projector.*``) in one module.

``VisionModel.state_dict()`` keys are exactly the released checkpoint names, so
:func:`expected_vision_tensors` (the names and shapes a config implies) is read off a meta-device instance and a
checkpoint's tensors load with ``load_state_dict(..., strict=True)``.

``forward(pixel_values, grid_thws)`` returns one ``[tokens_i, text_hidden]`` tensor per image (tokens_i =
h*w/(kh*kw)): these replace image i's ``<|media_pad|>`` positions in the LM input embeddings. Images are
independent, so a rank may run any subset and the per-image results be gathered afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn as nn

from rocm_k3.model.vision.config import VisionConfig
from rocm_k3.model.vision.projector import Projector
from rocm_k3.model.vision.tower import VisionTower

TOWER_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "mm_projector."


class PatchedImage(Protocol):
    """What :meth:`VisionModel.encode_images` needs of a preprocessed image (``preprocess.ProcessedImage``)."""

    pixel_values: torch.Tensor  # [h*w, 3, p, p]
    grid_thw: tuple[int, int, int]


class VisionModel(nn.Module):
    """Tower + projector; ``forward(pixel_values [N, 3, p, p], grid_thws) -> [per image: [n_i, text_hidden]]``."""

    def __init__(self, cfg: VisionConfig, *, backend: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg, backend=backend, device=device, dtype=dtype)
        self.mm_projector = Projector(cfg, backend=backend, device=device, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor,
                grid_thws: Sequence[Sequence[int]] | torch.Tensor) -> list[torch.Tensor]:
        merged = self.vision_tower(pixel_values, grid_thws)  # per image [n_i, kh*kw, D]
        if not merged:
            return []
        embeds = self.mm_projector(torch.cat(merged))  # [sum n_i, text_hidden]
        return list(embeds.split([m.shape[0] for m in merged]))

    def encode_images(self, images: Sequence[PatchedImage]) -> list[torch.Tensor]:
        """Run preprocessed images (in order) through tower and projector: one embedding tensor per image."""
        if not images:
            return []
        pixels = torch.cat([im.pixel_values for im in images])  # [N, 3, p, p]
        return self.forward(pixels, [im.grid_thw for im in images])


def expected_vision_tensors(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor the tower and projector of ``cfg`` need."""
    with torch.device("meta"):
        model = VisionModel(cfg, device="meta")
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
