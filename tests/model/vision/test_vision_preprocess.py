"""Image preprocessing (rocm_k3/model/vision/preprocess.py): resize rule, alpha, padding, patches, bad images."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from rocm_k3.model.vision.preprocess import (
    EmptyImageError,
    ImageTooLargeError,
    NotAnImageError,
    PreprocessConfig,
    chessboard,
    plan_resize,
    preprocess_image,
    preprocess_images,
)
from tests.helpers import seeded


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _random_rgb(w: int, h: int, seed: int = 0) -> Image.Image:
    data = torch.randint(0, 256, (h, w, 3), generator=seeded(seed), dtype=torch.uint8)
    return Image.fromarray(data.numpy(), "RGB")


def _unpatch(pixels: torch.Tensor, grid: tuple[int, int, int], p: int = 14) -> torch.Tensor:
    """[gh*gw, 3, p, p] -> [3, gh*p, gw*p] by explicit loops (the inverse of the row-major patch order)."""
    _, gh, gw = grid
    img = torch.empty(3, gh * p, gw * p)
    for r in range(gh):
        for c in range(gw):
            img[:, r * p:(r + 1) * p, c * p:(c + 1) * p] = pixels[r * gw + c]
    return img


def _normed(rgb: Image.Image) -> torch.Tensor:
    t = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.size[1], rgb.size[0], 3)
    return (t.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5


def test_small_image_is_padded_not_resized() -> None:
    image = _random_rgb(30, 45, seed=1)  # W x H, neither a multiple of 28
    out = preprocess_image(_png(image))
    assert out.plan.original_size == (30, 45) and out.plan.resized_size == (30, 45)
    assert out.plan.padded_size == (56, 56) and out.grid_thw == (1, 4, 4) and out.num_tokens == 4
    assert out.pixel_values.shape == (16, 3, 14, 14) and out.pixel_values.dtype == torch.float32
    img = _unpatch(out.pixel_values, out.grid_thw)
    assert torch.equal(img[:, :45, :30], _normed(image))
    assert (img[:, 45:, :] == -1).all() and (img[:, :, 30:] == -1).all()  # zeros before normalising


def test_one_pixel_image() -> None:
    out = preprocess_image(Image.new("RGB", (1, 1), (255, 0, 51)))
    assert out.plan.resized_size == (1, 1) and out.grid_thw == (1, 2, 2) and out.num_tokens == 1
    img = _unpatch(out.pixel_values, out.grid_thw)
    assert img[:, 0, 0].tolist() == pytest.approx([1.0, -1.0, 51 / 255 * 2 - 1])
    assert (img.flatten(1)[:, 1:] == -1).all()


def test_huge_image_is_cut_to_the_patch_limits() -> None:
    # 20000 x 300: the per-side limit (512 patches = 7168 px) binds
    plan = plan_resize(20000, 300, PreprocessConfig())
    assert plan.resized_size == (7168, int(300 * 7168 / 20000)) and plan.grid_thw[2] == 512
    # 9000 x 9000: the total budget binds, sqrt(65536 / (642 * 642))
    plan = plan_resize(9000, 9000, PreprocessConfig())
    s = (65536 / (642 * 642)) ** 0.5
    assert plan.resized_size == (int(9000 * s), int(9000 * s))
    assert (plan.resized_size[0] // 14) ** 2 <= 65536
    # a real (small-limit) resize through PIL, patches within the limits
    cfg = PreprocessConfig(in_patch_limit=64, patch_limit_on_one_side=10)
    out = preprocess_image(_random_rgb(500, 300, seed=2), cfg)
    w, h = out.plan.resized_size
    assert (w // 14) * (h // 14) <= 64 and out.grid_thw[1] <= 10 and out.grid_thw[2] <= 10
    assert out.pixel_values.shape[0] == out.grid_thw[1] * out.grid_thw[2]
    assert out.plan.original_size == (500, 300)
    img = _unpatch(out.pixel_values, out.grid_thw)
    resized = _random_rgb(500, 300, seed=2).resize((w, h), Image.Resampling.BICUBIC)
    assert torch.equal(img[:, :h, :w], _normed(resized))  # PIL BICUBIC


def test_alpha_composited_on_a_chessboard() -> None:
    rgba = torch.zeros(20, 20, 4, dtype=torch.uint8)
    rgba[..., 0] = 200  # red
    rgba[:10, :, 3] = 0  # top half transparent
    rgba[10:, :10, 3] = 255  # bottom-left opaque
    rgba[10:, 10:, 3] = 128  # bottom-right half transparent
    out = preprocess_image(Image.fromarray(rgba.numpy(), "RGBA"))
    img = _unpatch(out.pixel_values, out.grid_thw)[:, :20, :20]
    board = _normed(chessboard((20, 20)))
    assert torch.equal(img[:, :10], board[:, :10])  # fully transparent: the chessboard
    assert img[:, 0, 0].tolist() == [1.0, 1.0, 1.0] and img[0, 0, 8].item() == pytest.approx(180 / 255 * 2 - 1)
    assert torch.equal(img[:, 10:, :10], _normed(Image.new("RGB", (10, 10), (200, 0, 0))))  # opaque: the image
    # half transparent over a 255 square (rows 10..15, cols 10..15 lie in board square (1, 1): light)
    expected = Image.alpha_composite(Image.new("RGBA", (1, 1), (255, 255, 255, 255)),
                                     Image.new("RGBA", (1, 1), (200, 0, 0, 128))).convert("RGB")
    assert torch.equal(img[:, 12, 12], _normed(expected)[:, 0, 0])


def test_palette_and_la_transparency_take_the_alpha_path() -> None:
    pal = Image.new("P", (16, 16), 0)
    pal.putpalette([10, 20, 30] * 256)
    pal.info["transparency"] = 0
    out = preprocess_image(_png(pal))
    assert torch.equal(_unpatch(out.pixel_values, out.grid_thw)[:, :16, :16], _normed(chessboard((16, 16))))
    la = Image.new("LA", (16, 16), (90, 0))
    out = preprocess_image(la)
    assert torch.equal(_unpatch(out.pixel_values, out.grid_thw)[:, :16, :16], _normed(chessboard((16, 16))))
    grey = preprocess_image(Image.new("L", (16, 16), 90))  # no alpha: plain conversion
    assert torch.equal(_unpatch(grey.pixel_values, grey.grid_thw)[:, :16, :16],
                       _normed(Image.new("RGB", (16, 16), (90, 90, 90))))


def test_bad_images_raise_named_errors() -> None:
    with pytest.raises(NotAnImageError, match="not an image"):
        preprocess_image(b"certainly not a PNG")
    with pytest.raises(NotAnImageError, match="corrupt or truncated"):
        preprocess_image(_png(_random_rgb(64, 64))[:200])
    with pytest.raises(NotAnImageError, match="expected image bytes"):
        preprocess_image("a string")
    with pytest.raises(EmptyImageError, match="0 bytes"):
        preprocess_image(b"")
    with pytest.raises(EmptyImageError, match="zero size"):
        preprocess_image(Image.new("RGB", (0, 5)))
    with pytest.raises(ImageTooLargeError, match="bytes"):
        preprocess_image(_png(_random_rgb(64, 64)), PreprocessConfig(max_image_bytes=100))
    bomb = _png(Image.new("1", (9000, 9000)))  # 81 Mpx in ~10 kB: refused from the header, before decoding
    assert len(bomb) < 100_000
    with pytest.raises(ImageTooLargeError, match="pixels exceeds"):
        preprocess_image(bomb)
    with pytest.raises(NotAnImageError, match="image 1:"):  # the batch names the bad image
        preprocess_images([_random_rgb(4, 4), b"junk"])


def test_preprocessor_config_file(tmp_path) -> None:
    assert PreprocessConfig.from_dir(tmp_path) == PreprocessConfig()  # no file: the K3 defaults
    nested = {"media_proc_cfg": {"in_patch_limit": 1024, "patch_limit_on_one_side": 32, "merge_kernel_size": [2, 2],
                                 "image_mean": [0.4, 0.5, 0.6], "image_std": [0.5, 0.5, 0.5],
                                 "fixed_output_tokens": None, "in_patch_limit_video": 9999}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(nested))
    cfg = PreprocessConfig.from_dir(tmp_path)
    assert (cfg.in_patch_limit, cfg.patch_limit_on_one_side, cfg.image_mean) == (1024, 32, (0.4, 0.5, 0.6))
    assert PreprocessConfig.from_dict({"patch_size": 14, "in_patch_limit": 4096}).in_patch_limit == 4096
    with pytest.raises(ValueError, match="fixed_output_tokens"):
        PreprocessConfig.from_dict({"fixed_output_tokens": 64})
    with pytest.raises(ValueError, match="square kernel"):
        PreprocessConfig.from_dict({"merge_kernel_size": [2, 4]})
    with pytest.raises(ValueError, match="image_std"):
        PreprocessConfig(image_std=(0.5, 0.0, 0.5))
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        PreprocessConfig.from_dir(tmp_path)


def test_mean_std_applied_per_channel() -> None:
    cfg = PreprocessConfig(image_mean=(0.0, 0.5, 1.0), image_std=(1.0, 0.5, 0.25))
    out = preprocess_image(Image.new("RGB", (2, 2), (255, 255, 0)), cfg)
    assert _unpatch(out.pixel_values, out.grid_thw)[:, 0, 0].tolist() == pytest.approx([1.0, 1.0, -4.0])
