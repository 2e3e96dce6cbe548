"""Prompt expansion for images, as pure functions over token ids (SERVING_SPEC 6.4).

Each image becomes one block of ids where the caller placed it:

- K3:   ``<|media_begin|>`` + text ``image {W}x{H}`` + ``<|media_content|>`` + N x ``<|media_pad|>`` + ``<|media_end|>``
- K2.5: ``<|media_begin|>`` + text ``image`` + ``<|media_content|>`` + N x ``<|media_pad|>`` + ``<|media_end|>``

with W x H the original upload size and N the image's token count; only the ``<|media_pad|>`` positions are
embedding slots (:func:`scatter_image_embeddings` writes the projector's rows there).

**Where images go is the caller's decision.** :func:`expand_prompt` takes insertion indices into the prompt's ids
(the chat renderer knows where each ``image_url`` part is; ``LLM.generate`` splits a raw prompt on the config's
``image_placeholder`` with :func:`raw_prompt_image_positions`). Placeholder text typed inside a chat message is
ordinary text and gets no slot, because nothing here searches ids for it; and a prompt whose ids already hold a
media token (e.g. a tokenizer that maps typed ``<|media_pad|>`` text to its special id) is refused, so no slot
exists without an image.

**Prefix-cache salt.** Each slot carries ``content_hash`` = sha256 over the preprocessed pixels and the grid.
:func:`prefix_cache_key` (:mod:`rocm_k3.cache.image_salt`, torch-free for the control plane) gives the ids the
prefix cache should match on: the prompt's ids with every pad of an image replaced by an id derived from its hash
(far above any vocabulary id), so equal text with different images never shares a cache entry and identical image
prompts do.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from rocm_k3.cache.image_salt import MEDIA_KEY_BASE, prefix_cache_key  # noqa: F401 (re-exported: the salt)
from rocm_k3.formats.k3_chat import IMAGE_PLACEHOLDER  # K3 config.json ``image_placeholder``

MEDIA_TOKEN_NAMES = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
PROMPT_STYLES = ("k3", "k25")
_HASH_TAG = b"rocm-k3/image/v1"


class MediaTokenInPromptError(ValueError):
    """The prompt's own ids contain a media token: only images may introduce them."""


class ImagePlacementError(ValueError):
    """Image positions that do not fit the prompt or the images (count, order, range)."""


@dataclasses.dataclass(frozen=True)
class MediaTokens:
    """The tokenizer's ids of ``<|media_begin|>``, ``<|media_content|>``, ``<|media_end|>``, ``<|media_pad|>``."""

    begin: int
    content: int
    end: int
    pad: int

    def __post_init__(self) -> None:
        ids = (self.begin, self.content, self.end, self.pad)
        for name, value in zip(MEDIA_TOKEN_NAMES, ids):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative token id, got {value!r}")
        if len(set(ids)) != 4:
            raise ValueError(f"the four media token ids must differ, got {ids}")

    @property
    def ids(self) -> frozenset[int]:
        return frozenset((self.begin, self.content, self.end, self.pad))

    @classmethod
    def from_lookup(cls, lookup: Callable[[str], int | None]) -> MediaTokens:
        """From a tokenizer's token -> id lookup (e.g. ``tokenizer.token_to_id``); names the missing ones."""
        found = {name: lookup(name) for name in MEDIA_TOKEN_NAMES}
        missing = [name for name, value in found.items() if value is None]
        if missing:
            raise ValueError(f"the tokenizer has no id for the media tokens {missing}")
        return cls(*(found[name] for name in MEDIA_TOKEN_NAMES))


K3_MEDIA_TOKENS = MediaTokens(163602, 163603, 163604, 163605)  # K2.5 uses the same ids


class ImageForPrompt(Protocol):
    """What the prompt needs of a preprocessed image (``preprocess.ProcessedImage`` has these)."""

    pixel_values: torch.Tensor

    @property
    def grid_thw(self) -> tuple[int, int, int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def original_size(self) -> tuple[int, int]: ...


@dataclasses.dataclass(frozen=True)
class ImageSlot:
    """Where one image's block landed in the expanded ids."""

    block_start: int  # index of <|media_begin|>
    block_end: int  # one past <|media_end|>
    pad_start: int  # index of the first <|media_pad|>
    num_tokens: int  # pads (= rows of the image's embeddings)
    content_hash: str  # sha256 hex of the preprocessed pixels + grid

    @property
    def pad_positions(self) -> range:
        return range(self.pad_start, self.pad_start + self.num_tokens)


class PromptImages(abc.ABC):
    """The image facts of a prompt with its images expanded, read from its per-image entries
    (:meth:`image_entries`, in prompt order: each has ``pad_positions`` and ``content_hash``)."""

    @abc.abstractmethod
    def image_entries(self) -> Sequence[Any]: ...

    @property
    def pad_positions(self) -> list[int]:
        """Every ``<|media_pad|>`` index, image after image (the rows of the concatenated image embeddings)."""
        return [p for entry in self.image_entries() for p in entry.pad_positions]

    @property
    def image_hashes(self) -> list[str]:
        return [entry.content_hash for entry in self.image_entries()]


@dataclasses.dataclass(frozen=True)
class ExpandedPrompt(PromptImages):
    """The prompt's ids with every image block inserted, and the slots in image order."""

    token_ids: list[int]
    slots: list[ImageSlot]

    def image_entries(self) -> list[ImageSlot]:
        return self.slots


def image_content_hash(pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> str:
    """sha256 (hex) of the grid (t, h, w) and the fp32 bytes of the preprocessed pixels."""
    if len(grid_thw) != 3:
        raise ValueError(f"grid_thw: expected (t, h, w), got {tuple(grid_thw)!r}")
    h = hashlib.sha256(_HASH_TAG)
    h.update(b"".join(int(v).to_bytes(8, "little", signed=False) for v in grid_thw))
    pixels = pixel_values.detach().to(device="cpu", dtype=torch.float32).contiguous()
    h.update(str(list(pixels.shape)).encode())
    h.update(pixels.numpy().tobytes())
    return h.hexdigest()


def image_block(tokens: MediaTokens, num_tokens: int, original_size: tuple[int, int],
                encode_text: Callable[[str], list[int]], style: str = "k3") -> list[int]:
    """The ids of one image block (module docstring); ``encode_text`` is the tokenizer's plain-text encoder."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"style: expected one of {PROMPT_STYLES}, got {style!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens: expected a positive integer, got {num_tokens!r}")
    w, h = original_size
    text = f"image {w}x{h}" if style == "k3" else "image"
    label = list(encode_text(text))
    if tokens.ids.intersection(label):
        raise MediaTokenInPromptError(f"the tokenizer encodes {text!r} with a media token id: {label}")
    return [tokens.begin, *label, tokens.content, *([tokens.pad] * num_tokens), tokens.end]


def expand_prompt(prompt_ids: Sequence[int], image_positions: Sequence[int], images: Sequence[ImageForPrompt],
                  tokens: MediaTokens, encode_text: Callable[[str], list[int]], *,
                  style: str = "k3") -> ExpandedPrompt:
    """Insert image i's block before ``prompt_ids[image_positions[i]]`` (``len(prompt_ids)``: at the end).

    ``image_positions`` are indices chosen by the caller (renderer or engine), non-decreasing, one per image;
    images at the same index keep their order. Raises :class:`ImagePlacementError` for a count/order/range
    mismatch and :class:`MediaTokenInPromptError` when ``prompt_ids`` already contain a media token id.
    """
    ids = list(prompt_ids)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError("prompt_ids: expected non-negative integer token ids")
    stray = [i for i, t in enumerate(ids) if t in tokens.ids]
    if stray:
        raise MediaTokenInPromptError(
            f"the prompt already holds media token ids at positions {stray[:8]}: only images may add them"
        )
    positions = list(image_positions)
    if len(positions) != len(images):
        raise ImagePlacementError(f"{len(images)} images but {len(positions)} image positions")
    for i, pos in enumerate(positions):
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= len(ids):
            raise ImagePlacementError(f"image_positions[{i}] = {pos!r} is outside [0, {len(ids)}]")
        if i and pos < positions[i - 1]:
            raise ImagePlacementError(f"image_positions must be non-decreasing, got {positions}")
    out: list[int] = []
    slots: list[ImageSlot] = []
    cursor = 0
    for pos, image in zip(positions, images):
        out.extend(ids[cursor:pos])
        cursor = pos
        block = image_block(tokens, image.num_tokens, image.original_size, encode_text, style)
        start = len(out)
        out.extend(block)
        pad_start = start + len(block) - 1 - image.num_tokens
        slots.append(ImageSlot(start, len(out), pad_start, image.num_tokens,
                               image_content_hash(image.pixel_values, image.grid_thw)))
    out.extend(ids[cursor:])
    return ExpandedPrompt(out, slots)


def raw_prompt_image_positions(text: str, num_images: int, encode_text: Callable[[str], list[int]],
                               placeholder: str = IMAGE_PLACEHOLDER) -> tuple[list[int], list[int]]:
    """For a raw (non-chat) prompt whose author marks each image with ``placeholder``: (ids, image positions).

    The text is split on the placeholder and the pieces encoded one by one, so the placeholder itself never
    becomes ids. With no placeholder all images go before the text; otherwise the count must equal
    ``num_images`` (ImagePlacementError). Chat renderers must not use this on message text: there the image
    parts decide the positions and placeholder text stays text.
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    pieces = text.split(placeholder)
    if len(pieces) == 1:
        return list(encode_text(text)), [0] * num_images
    if len(pieces) - 1 != num_images:
        raise ImagePlacementError(
            f"the prompt has {len(pieces) - 1} {placeholder} markers but {num_images} images were given"
        )
    ids: list[int] = []
    positions: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            positions.append(len(ids))
        ids.extend(encode_text(piece) if piece else [])
    return ids, positions


def scatter_image_embeddings(inputs_embeds: torch.Tensor, pad_positions: Sequence[int] | torch.Tensor,
                             image_embeds: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """``inputs_embeds [T, hidden]`` with rows ``pad_positions [N]`` replaced by ``image_embeds [N, hidden]``.

    ``image_embeds`` may be one tensor or the per-image tensors in slot order (concatenated). Returns a new
    tensor in inputs_embeds' dtype; raises ValueError when the row counts, widths or positions disagree.
    """
    if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 2:
        raise ValueError(f"inputs_embeds must be a [T, hidden] tensor, got "
                         f"{list(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor) else inputs_embeds!r}")
    if not isinstance(image_embeds, torch.Tensor):
        parts = list(image_embeds)
        image_embeds = torch.cat(parts) if parts else inputs_embeds.new_zeros(0, inputs_embeds.shape[1])
    if image_embeds.dim() != 2 or image_embeds.shape[1] != inputs_embeds.shape[1]:
        raise ValueError(f"image_embeds must be [N, {inputs_embeds.shape[1]}], got {list(image_embeds.shape)}")
    pos = torch.as_tensor(pad_positions, dtype=torch.int64).reshape(-1)
    if pos.numel() != image_embeds.shape[0]:
        raise ValueError(f"{pos.numel()} <|media_pad|> positions but {image_embeds.shape[0]} image embedding rows")
    if pos.numel():
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= inputs_embeds.shape[0]:
            raise ValueError(f"pad positions span [{lo}, {hi}], outside [0, {inputs_embeds.shape[0]})")
        if torch.unique(pos).numel() != pos.numel():
            raise ValueError("pad positions repeat a row")
    pos = pos.to(inputs_embeds.device)
    return inputs_embeds.index_copy(0, pos, image_embeds.to(device=inputs_embeds.device, dtype=inputs_embeds.dtype))
