"""Test helpers for images through the engine: seeded noise images and the direct (engine-free) greedy path."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from simple_cache import SimpleCache
from rocm_k3.model.vision.preprocess import PreprocessConfig, preprocess_image
from rocm_k3.model.vision.prompt import ExpandedPrompt, MediaTokens, expand_prompt


class Patched(NamedTuple):
    """What the tower takes of an image (a ProcessedImage or an ImageInput's numpy pixels, as a tensor)."""

    pixel_values: torch.Tensor  # [patches, 3, p, p]
    grid_thw: tuple[int, int, int]


def noise_image(seed: int, width: int, height: int) -> Image.Image:
    """An RGB image of seeded uniform noise (every pixel matters to the tower)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def expand_directly(tokenizer, prompt_ids: Sequence[int], positions: Sequence[int], images: Sequence[Image.Image],
                    preprocess: PreprocessConfig) -> tuple[ExpandedPrompt, list]:
    """The K3 expansion written out with the model-side functions (no MultiModalProcessor)."""
    processed = [preprocess_image(im, preprocess) for im in images]
    media = MediaTokens.from_lookup(tokenizer.special_tokens.get)
    return expand_prompt(list(prompt_ids), list(positions), processed, media, tokenizer.encode), processed


def direct_greedy(model, vision_model, token_ids: Sequence[int], pad_positions: Sequence[int], processed: list,
                  max_tokens: int, *, max_model_len: int | None = None, block_size: int = 16) -> list[int]:
    """Greedy tokens of the text model fed the image embeddings directly: the tower + projector run on the
    preprocessed images (``processed``: ProcessedImage or ImageInput items), the rows go to the pad positions of
    one whole-prompt prefill (SimpleCache), then one decode step per token. ``max_model_len`` / ``block_size`` set
    the block-table width (GPU kernels size their splits by it)."""
    with torch.inference_mode():
        pixels = [Patched(torch.as_tensor(p.pixel_values).to(model.device), p.grid_thw) for p in processed]
        embeds = torch.cat(vision_model.encode_images(pixels)) if processed else None  # [pads, hidden]
    cache = SimpleCache(model.cfg, max_seqs=1, max_model_len=max_model_len or len(token_ids) + max_tokens,
                        block_size=block_size, dtype=model.dtype, device=model.device)
    batch = cache.prepare([(0, list(token_ids))])
    if embeds is not None:
        rows = torch.tensor(list(pad_positions), dtype=torch.int64, device=model.device)
        batch = dataclasses.replace(batch, image_embeds=embeds.to(model.device, model.dtype), image_rows=rows)
    out = []
    for _ in range(max_tokens):
        token = int(model.forward(batch, cache)[0].argmax())
        out.append(token)
        batch = cache.prepare([(0, [token])])
    return out
