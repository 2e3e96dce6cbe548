"""Image preprocessing with Pillow: decode, NaViT resize, alpha, pad, normalise, patchify (SERVING_SPEC 6.4).

For an upload of W x H pixels (p = patch size 14, m = merge size 2):

1. **Resize** by ``s = min(1, sqrt(in_patch_limit / (max(1, W//p) * max(1, H//p))), L*p/W, L*p/H)`` with
   L = patch_limit_on_one_side: new size ``(max(1, floor(W*s)), max(1, floor(H*s)))``, each capped at L*p,
   resampled with PIL BICUBIC (never upscaled).
2. **Alpha**: an image with transparency is composited, after the resize, onto a chessboard of 8-pixel squares
   (grey levels 255 and 180, the top-left square 255), so transparent regions are neither black nor white.
3. **Pad** right and bottom with zeros to multiples of m*p = 28 (before normalisation, so padding reads -1).
4. **Normalise** ``(x / 255 - mean) / std`` per channel (mean = std = 0.5) in fp32.
5. **Patchify** to ``[gh * gw, 3, p, p]``, patches row-major over the (gh, gw) = (H_pad/p, W_pad/p) grid, with
   ``grid_thw = (1, gh, gw)`` and ``num_tokens = (H_pad / 28) * (W_pad / 28)`` (at most 16,384 per image).

Bad input raises an :class:`ImageError` (a ValueError) subclass naming the problem: :class:`NotAnImageError`,
:class:`EmptyImageError` (zero bytes or a zero-sized image), :class:`ImageTooLargeError` (over the byte or the
pixel limit, checked from the header before decoding). The processor values come from a checkpoint's
``preprocessor_config.json`` (flat, or nested under ``media_proc_cfg`` as the K2.5/K3 releases write it) when
present, else the K3 defaults.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

PREPROCESSOR_FILE = "preprocessor_config.json"
CHESSBOARD_SQUARE = 8
CHESSBOARD_LEVELS = (255, 180)


class ImageError(ValueError):
    """An image the preprocessor refuses; the message says why."""


class NotAnImageError(ImageError):
    """The bytes are not an image Pillow can decode (or the object is not an image at all)."""


class EmptyImageError(ImageError):
    """Zero bytes, or an image with zero width or height."""


class ImageTooLargeError(ImageError):
    """More bytes or pixels than the configured limits."""


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    """Processor values (``preprocessor_config.json``) plus rocm-k3's input limits.

    in_patch_limit / patch_limit_on_one_side: the resize budget (65,536 patches, 512 patches a side in K3).
    max_image_bytes / max_image_pixels: uploads above either are refused before decoding (decompression bombs).
    """

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 8192 * 8192

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                     "max_image_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 3
                    or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)):
                raise ValueError(f"{name}: expected three finite numbers, got {value!r}")
        if not all(v > 0 for v in self.image_std):
            raise ValueError(f"image_std: expected positive values, got {self.image_std}")

    @property
    def factor(self) -> int:
        """Padding multiple: merge_kernel_size * patch_size (28)."""
        return self.merge_kernel_size * self.patch_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PreprocessConfig:
        """From a parsed ``preprocessor_config.json``: flat keys or a nested ``media_proc_cfg`` object."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{PREPROCESSOR_FILE}: expected a JSON object, got {type(raw).__name__}")
        cfg = raw.get("media_proc_cfg", raw)
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{PREPROCESSOR_FILE}: media_proc_cfg must be an object, got {type(cfg).__name__}")
        if cfg.get("fixed_output_tokens") is not None:
            raise ValueError("fixed_output_tokens: rocm-k3 implements the NaViT resize only (expected null)")
        kw: dict[str, Any] = {}
        for key in ("patch_size", "in_patch_limit", "patch_limit_on_one_side"):
            if cfg.get(key) is not None:
                kw[key] = cfg[key]
        merge = cfg.get("merge_kernel_size", cfg.get("merge_size"))
        if merge is not None:
            if isinstance(merge, (list, tuple)):
                if len(set(merge)) != 1:
                    raise ValueError(f"merge_kernel_size: expected a square kernel, got {merge!r}")
                merge = merge[0]
            kw["merge_kernel_size"] = merge
        for key in ("image_mean", "image_std"):
            if cfg.get(key) is not None:
                value = cfg[key]
                kw[key] = tuple(value) if isinstance(value, (list, tuple)) else value
        return cls(**kw)

    @classmethod
    def from_dir(cls, directory: str | Path) -> PreprocessConfig:
        """A checkpoint directory's ``preprocessor_config.json``, else the K3 defaults."""
        file = Path(directory) / PREPROCESSOR_FILE
        if not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw)


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """Sizes of one image through the pipeline (width first, as PIL orders them)."""

    original_size: tuple[int, int]  # (W, H) of the upload: the K3 prompt writes "image {W}x{H}"
    resized_size: tuple[int, int]  # after the NaViT resize
    padded_size: tuple[int, int]  # after padding to multiples of 28
    grid_thw: tuple[int, int, int]  # (1, H_pad / p, W_pad / p)
    num_tokens: int  # (H_pad / 28) * (W_pad / 28): the <|media_pad|> count


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One preprocessed image: ``pixel_values`` fp32 ``[gh * gw, 3, p, p]`` and its sizes (:class:`ResizePlan`)."""

    pixel_values: torch.Tensor
    plan: ResizePlan

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return self.plan.grid_thw

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def original_size(self) -> tuple[int, int]:
        return self.plan.original_size


def plan_resize(width: int, height: int, cfg: PreprocessConfig) -> ResizePlan:
    """The NaViT resize rule (module docstring, step 1) and the padded grid for a W x H image."""
    if width <= 0 or height <= 0:
        raise EmptyImageError(f"image has zero size ({width} x {height} pixels)")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0, math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    pad_w, pad_h = -(-new_w // cfg.factor) * cfg.factor, -(-new_h // cfg.factor) * cfg.factor
    grid = (1, pad_h // p, pad_w // p)
    tokens = (pad_h // cfg.factor) * (pad_w // cfg.factor)
    return ResizePlan((width, height), (new_w, new_h), (pad_w, pad_h), grid, tokens)


def open_image(data: bytes | bytearray | memoryview | Image.Image, cfg: PreprocessConfig) -> Image.Image:
    """Decode upload bytes (or take a PIL image), refusing what is not an image, empty, or over the limits."""
    if isinstance(data, Image.Image):
        _check_size(data.size, cfg)
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise NotAnImageError(f"expected image bytes or a PIL image, got {type(data).__name__}")
    if len(data) == 0:
        raise EmptyImageError("the image is empty (0 bytes)")
    if len(data) > cfg.max_image_bytes:
        raise ImageTooLargeError(f"the image has {len(data)} bytes, more than the limit of {cfg.max_image_bytes}")
    try:
        image = Image.open(io.BytesIO(bytes(data)))  # reads the header only
        _check_size(image.size, cfg)  # before any pixel is decoded
        image.load()
    except Image.DecompressionBombError as exc:  # Pillow's own ceiling, for limits set above it
        raise ImageTooLargeError(f"the image is too large to decode safely ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise NotAnImageError("the bytes are not an image in a format Pillow can read") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise NotAnImageError(f"the image data is corrupt or truncated ({exc})") from exc
    return image


def _check_size(size: tuple[int, int], cfg: PreprocessConfig) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise EmptyImageError(f"image has zero size ({w} x {h} pixels)")
    if w * h > cfg.max_image_pixels:
        raise ImageTooLargeError(f"image of {w} x {h} = {w * h} pixels exceeds the limit of {cfg.max_image_pixels}")


def has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info)


def chessboard(size: tuple[int, int]) -> Image.Image:
    """An RGB chessboard of 8-pixel squares, grey 255 (top-left) and 180."""
    w, h = size
    ys = torch.arange(h)[:, None] // CHESSBOARD_SQUARE
    xs = torch.arange(w)[None, :] // CHESSBOARD_SQUARE
    light, dark = CHESSBOARD_LEVELS
    grey = torch.where((xs + ys) % 2 == 0, light, dark).to(torch.uint8)  # [h, w]
    return Image.frombytes("L", (w, h), grey.contiguous().numpy().tobytes()).convert("RGB")


def to_rgb(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Resize to ``size`` with BICUBIC (a no-op at the same size) and flatten to RGB (alpha onto a chessboard)."""
    if has_alpha(image):
        rgba = image.convert("RGBA")
        if rgba.size != size:
            rgba = rgba.resize(size, resample=Image.Resampling.BICUBIC)
        board = chessboard(size).convert("RGBA")
        return Image.alpha_composite(board, rgba).convert("RGB")
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return rgb if rgb.size == size else rgb.resize(size, resample=Image.Resampling.BICUBIC)


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[3, H, W]`` (H, W multiples of p) -> ``[H/p * W/p, 3, p, p]``, patches row-major over the grid."""
    c, h, w = image.shape
    p = patch_size
    grid = image.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4)  # [gh, gw, 3, p, p]
    return grid.reshape((h // p) * (w // p), c, p, p).contiguous()


def preprocess_image(data: bytes | bytearray | memoryview | Image.Image,
                     cfg: PreprocessConfig | None = None) -> ProcessedImage:
    """One upload (bytes or PIL image) -> :class:`ProcessedImage` (module docstring, steps 1-5)."""
    cfg = cfg or PreprocessConfig()
    image = open_image(data, cfg)
    plan = plan_resize(*image.size, cfg)
    try:
        rgb = to_rgb(image, plan.resized_size)
    except (OSError, ValueError) as exc:  # e.g. a mode Pillow cannot convert to RGB
        raise NotAnImageError(f"cannot convert the {image.mode} image to RGB ({exc})") from exc
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    new_w, new_h = plan.resized_size
    pad_w, pad_h = plan.padded_size
    canvas = torch.zeros(3, pad_h, pad_w, dtype=torch.float32)  # zero padding right and bottom
    canvas[:, :new_h, :new_w] = pixels.view(new_h, new_w, 3).permute(2, 0, 1).float()
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(cfg.image_std, dtype=torch.float32)[:, None, None]
    normed = (canvas / 255.0 - mean) / std  # padding: (0 - 0.5) / 0.5 = -1
    return ProcessedImage(patchify(normed, cfg.patch_size), plan)


def preprocess_images(images: Sequence[bytes | bytearray | memoryview | Image.Image],
                      cfg: PreprocessConfig | None = None) -> list[ProcessedImage]:
    """Each image through :func:`preprocess_image`; the first bad one raises, naming its index."""
    out = []
    for i, image in enumerate(images):
        try:
            out.append(preprocess_image(image, cfg))
        except ImageError as exc:
            raise type(exc)(f"image {i}: {exc}") from exc
    return out
