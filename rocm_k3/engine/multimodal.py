"""The image input processor: a prompt and its images -> the expanded ids and the engine's image inputs.

Runs before the engine (control plane, no model): Pillow preprocessing
(:func:`~rocm_k3.model.vision.preprocess.preprocess_images`), the K3 expansion of each image where the caller
placed it (:func:`~rocm_k3.model.vision.prompt.expand_prompt`: ``<|media_begin|>image WxH<|media_content|>`` +
N x ``<|media_pad|>`` + ``<|media_end|>``; K2.5's size-less form for a ``patchmerger`` tower), each image's
content hash, and the picklable :class:`~rocm_k3.worker.step_io.ImageInput` s the step contract carries (numpy
pixel arrays + grid + pad span). The result, :class:`MultiModalPrompt`, goes to
``EngineCore.add_request(request_id, mm.token_ids, params, images=mm.images)``.

**Where images go.**

- A raw prompt string (``LLM.generate({"prompt": ..., "multi_modal_data": {"image": ...}})``): the checkpoint's
  ``image_placeholder`` (``<|kimi_image_placeholder|>``) marks each image's place, one marker per image; a
  prompt without any marker gets all its images before the text (:meth:`MultiModalProcessor.process_prompt`).
- Token ids (``"prompt_token_ids"``, or a chat rendering): the caller gives the insertion index of each image
  (:meth:`MultiModalProcessor.process_images`; none = all before the text). The chat path renders with
  ``K3ChatRenderer`` and passes ``rendered.token_ids`` and ``rendered.image_positions``: the renderer reports
  where each ``image_url`` part sits, so placeholder text a user types inside a message stays plain text (the ids
  are never searched for it).

Bad images raise the :class:`~rocm_k3.model.vision.preprocess.ImageError` subclasses (ValueErrors naming the
image): ``NotAnImageError``, ``EmptyImageError``, ``ImageTooLargeError``; bad placements ``ImagePlacementError``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from rocm_k3.cache.image_salt import prefix_cache_key
from rocm_k3.model.config import read_config_json
from rocm_k3.model.vision.config import VisionConfig
from rocm_k3.model.vision.preprocess import PreprocessConfig, ProcessedImage, preprocess_images
from rocm_k3.model.vision.prompt import (
    IMAGE_PLACEHOLDER,
    MediaTokens,
    PromptImages,
    expand_prompt,
    raw_prompt_image_positions,
)
from rocm_k3.worker.step_io import ImageInput

log = logging.getLogger("rocm_k3.engine")

ImageData = Image.Image | bytes | bytearray | memoryview  # a PIL image or the bytes of an image file
_BYTES = (bytes, bytearray, memoryview)


@dataclasses.dataclass(frozen=True)
class MultiModalPrompt(PromptImages):
    """A prompt with its images expanded (``pad_positions`` and ``image_hashes`` from :class:`PromptImages`).

    token_ids: the expanded prompt (what the model runs); images: one ImageInput per image, in prompt order
    (preprocessed pixels as numpy arrays, grid, pad span, content hash).
    """

    token_ids: list[int]
    images: tuple[ImageInput, ...]

    def image_entries(self) -> tuple[ImageInput, ...]:
        return self.images

    @property
    def cache_key_ids(self) -> list[int]:
        """The ids the prefix cache hashes: ``token_ids`` with each image's pads replaced by an id derived from its
        content hash (what the engine computes for the request)."""
        return prefix_cache_key(self.token_ids, self.images)


def as_image_list(images: Any, where: str = "images") -> list[ImageData]:
    """One image (PIL image or bytes) or a list of them -> a list; TypeError naming ``where`` otherwise."""
    if isinstance(images, (Image.Image, *_BYTES)):
        return [images]
    if isinstance(images, (list, tuple)):
        return list(images)
    raise TypeError(f"{where}: expected a PIL image, image bytes or a list of those, got {type(images).__name__}")


class MultiModalProcessor:
    """Images for one model (see the module docstring).

    media: the tokenizer's media token ids; encode_text: its plain-text encoder (no specials); preprocess: the
    checkpoint's processor values and input limits; style: "k3" (``image WxH`` in the block) or "k25";
    placeholder: the raw-prompt image marker.
    """

    def __init__(self, media: MediaTokens, encode_text: Callable[[str], list[int]],
                 preprocess: PreprocessConfig | None = None, *, style: str = "k3",
                 placeholder: str = IMAGE_PLACEHOLDER) -> None:
        if not isinstance(media, MediaTokens):
            raise TypeError(f"media: expected MediaTokens, got {type(media).__name__}")
        if not isinstance(placeholder, str) or not placeholder:
            raise ValueError(f"placeholder: expected a non-empty string, got {placeholder!r}")
        self.media = media
        self.encode_text = encode_text
        self.preprocess = preprocess or PreprocessConfig()
        self.style = style
        self.placeholder = placeholder

    @classmethod
    def from_checkpoint(cls, path: str | Path, tokenizer: Any) -> MultiModalProcessor | None:
        """The processor of a checkpoint directory, or None when its ``config.json`` has no ``vision_config``.

        The media ids come from ``tokenizer`` (as vLLM does; a ``media_placeholder_token_id`` that disagrees is
        logged), the limits from ``preprocessor_config.json``, the marker from ``image_placeholder``.
        """
        raw = read_config_json(path)
        vision = VisionConfig.from_checkpoint_config(raw)
        if vision is None:
            return None
        if tokenizer is None:
            raise ValueError(f"{path}: a vision model needs a tokenizer (its media token ids and image labels)")
        media = MediaTokens.from_lookup(tokenizer.special_tokens.get)
        configured = raw.get("media_placeholder_token_id")
        if configured is not None and configured != media.pad:
            log.warning("config.json media_placeholder_token_id %r differs from the tokenizer's <|media_pad|> %d; "
                        "using the tokenizer's", configured, media.pad)
        placeholder = raw.get("image_placeholder", IMAGE_PLACEHOLDER)
        if not isinstance(placeholder, str) or not placeholder:
            raise ValueError(f"{path}/config.json image_placeholder: expected a non-empty string, got {placeholder!r}")
        style = "k3" if vision.projector_type == "patchmergerv2" else "k25"
        return cls(media, tokenizer.encode, PreprocessConfig.from_dir(path), style=style, placeholder=placeholder)

    def process_prompt(self, prompt: str, images: Any) -> MultiModalPrompt:
        """A raw prompt string whose author marks each image with the placeholder (none: images first)."""
        pictures = as_image_list(images)
        ids, positions = raw_prompt_image_positions(prompt, len(pictures), self.encode_text, self.placeholder)
        return self._expand(ids, positions, pictures)

    def process_images(self, prompt_ids: Sequence[int], image_positions: Sequence[int] | None,
                       images: Any) -> MultiModalPrompt:
        """Token ids (e.g. a chat rendering) with image i inserted before ``prompt_ids[image_positions[i]]``
        (``len(prompt_ids)``: at the end; None: every image before the text). The entry the chat path calls with
        ``RenderedChat.token_ids`` / ``RenderedChat.image_positions``."""
        pictures = as_image_list(images)
        positions = [0] * len(pictures) if image_positions is None else list(image_positions)
        return self._expand(list(prompt_ids), positions, pictures)

    def _expand(self, ids: list[int], positions: list[int], pictures: list[ImageData]) -> MultiModalPrompt:
        processed = preprocess_images(pictures, self.preprocess)
        expanded = expand_prompt(ids, positions, processed, self.media, self.encode_text, style=self.style)
        images = tuple(_image_input(p, slot.pad_start, slot.num_tokens, slot.content_hash)
                       for p, slot in zip(processed, expanded.slots))
        return MultiModalPrompt(expanded.token_ids, images)


def _image_input(image: ProcessedImage, pad_start: int, num_tokens: int, content_hash: str) -> ImageInput:
    pixels = image.pixel_values.detach().to("cpu").contiguous().numpy()  # float32 [patches, 3, p, p]
    return ImageInput(pixels, tuple(int(v) for v in image.grid_thw), pad_start, num_tokens, content_hash)


def named_image_error(exc: ValueError, where: str) -> ValueError:
    """The same error class (an ImageError, ImagePlacementError, ...) with ``where`` (e.g. "prompt 2") in front of
    its message."""
    return type(exc)(f"{where}: {exc}")


def multi_modal_images(data: Any, where: str) -> list[ImageData]:
    """The images of a request's ``multi_modal_data`` (``{"image": one or a list}``); other modalities refused."""
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise TypeError(f"{where}.multi_modal_data: expected an object like {{'image': ...}}, got "
                        f"{type(data).__name__}")
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"{where}.multi_modal_data: rocm-k3 serves images only, got {other}")
    return as_image_list(data["image"], f"{where}.multi_modal_data['image']") if "image" in data else []
