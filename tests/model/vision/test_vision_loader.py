"""The vision loader (rocm_k3/model/vision/loader.py), the tiny tower and ``rocm-k3 make-tiny --vision``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from rocm_k3.cli import main
from rocm_k3.model.loader import (
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    load_model,
)
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.model.vision.config import K3_VISION_CONFIG, K25_VISION_CONFIG, VisionConfig, VisionConfigError
from rocm_k3.model.vision.loader import load_vision_model
from rocm_k3.model.vision.model import expected_vision_tensors
from rocm_k3.model.vision.preprocess import PreprocessConfig, preprocess_image
from rocm_k3.model.vision.prompt import MediaTokens
from rocm_k3.model.vision.tiny import tiny_vision_tensors_and_config
from rocm_k3.tokenizers.byte import ByteTokenizer
from tests.vision_fixtures import random_vision_tensors, write_vision_checkpoint

SMALL_K3 = {**K3_VISION_CONFIG, "vt_hidden_size": 16, "vt_intermediate_size": 32, "vt_num_hidden_layers": 1,
            "vt_num_attention_heads": 2, "qkv_hidden_size": 24, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
            "mm_hidden_size": 16, "text_hidden_size": 24}


def _config(vision: dict | None = SMALL_K3) -> dict:
    cfg = {"model_type": "kimi_k3", "text_config": {"hidden_size": 24}}
    if vision is not None:
        cfg["vision_config"] = vision
    return cfg


def _write(root: Path, tensors: dict, vision: dict | None = SMALL_K3, **kw) -> Path:
    return write_vision_checkpoint(root, tensors, _config(vision), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shards", [1, 3])
def test_loads_released_k3_layout(tmp_path: Path, dtype: torch.dtype, shards: int) -> None:
    tensors = random_vision_tensors(SMALL_K3, seed=1)
    extra = {"language_model.model.embed_tokens.weight": torch.zeros(4, 24)}  # text tensors are ignored
    root = _write(tmp_path, {**tensors, **extra}, shards=shards)
    model = load_vision_model(root, dtype=dtype)
    state = model.state_dict()
    assert set(state) == set(tensors)
    assert all(torch.equal(state[k], tensors[k].to(dtype)) and state[k].dtype == dtype for k in tensors)
    assert not any(p.requires_grad for p in model.parameters())
    image = preprocess_image(Image.new("RGB", (60, 30), (1, 2, 3)))
    (emb,) = model.encode_images([image])
    assert emb.shape == (image.num_tokens, 24) and torch.isfinite(emb).all()


def test_loads_k25_layout(tmp_path: Path) -> None:
    raw = {**K25_VISION_CONFIG, "vt_hidden_size": 16, "vt_intermediate_size": 32, "vt_num_hidden_layers": 1,
           "vt_num_attention_heads": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "mm_hidden_size": 16,
           "text_hidden_size": 24}
    tensors = random_vision_tensors(raw, seed=2)
    assert "mm_projector.pre_norm.bias" in tensors and "vision_tower.encoder.blocks.0.wqkv.bias" in tensors
    model = load_vision_model(_write(tmp_path, tensors, raw), dtype=torch.float32)
    assert model.cfg.projector_type == "patchmerger" and set(model.state_dict()) == set(tensors)


def test_released_tensor_counts() -> None:
    k3 = expected_vision_tensors(VisionConfig.from_hf_dict(K3_VISION_CONFIG))
    k25 = expected_vision_tensors(VisionConfig.from_hf_dict(K25_VISION_CONFIG))
    def count(names: dict, prefix: str) -> int:
        return sum(n.startswith(prefix) for n in names)

    def params(names: dict, prefix: str) -> int:
        return sum(torch.Size(s).numel() for n, s in names.items() if n.startswith(prefix))

    assert (count(k25, "vision_tower."), count(k25, "mm_projector.")) == (329, 6)  # SERVING_SPEC 6.1
    assert (params(k3, "vision_tower."), params(k3, "mm_projector.")) == (401_214_464, 46_144_512)
    assert k3["vision_tower.encoder.blocks.26.wqkv.weight"] == (4608, 1024)
    assert k3["vision_tower.encoder.blocks.0.wo.weight"] == (1024, 1536)
    assert k3["mm_projector.proj.2.weight"] == (7168, 4096) and k3["mm_projector.post_norm.weight"] == (7168,)
    assert k3["vision_tower.patch_embed.pos_emb.weight"] == (64, 64, 1024)


def test_named_errors(tmp_path: Path) -> None:
    tensors = random_vision_tensors(SMALL_K3, seed=3)
    missing = dict(tensors)
    del missing["vision_tower.encoder.blocks.0.wo.weight"]
    with pytest.raises(MissingTensorError, match="blocks.0.wo.weight"):
        load_vision_model(_write(tmp_path / "missing", missing))
    biased = {**tensors, "vision_tower.encoder.blocks.0.wqkv.bias": torch.zeros(72)}  # K3 has no biases
    with pytest.raises(UnexpectedTensorError, match="wqkv.bias"):
        load_vision_model(_write(tmp_path / "unexpected", biased))
    stray = {**tensors, "multi_modal_projector.linear_1.weight": torch.zeros(2, 2)}  # another layout's names
    with pytest.raises(UnexpectedTensorError, match="multi_modal_projector"):
        load_vision_model(_write(tmp_path / "stray", stray))
    wrong = {**tensors, "mm_projector.proj.0.weight": torch.zeros(64, 63)}
    with pytest.raises(TensorShapeError, match=r"proj.0.weight: expected shape \[64, 64\], got \[64, 63\]"):
        load_vision_model(_write(tmp_path / "shape", wrong))
    root = _write(tmp_path / "int", tensors)
    from safetensors.torch import save_file

    save_file({"vision_tower.patch_embed.pos_emb.weight": torch.zeros(4, 4, 16, dtype=torch.int32)},
              str(root / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "pos_emb" not in k}, str(root / "other.safetensors"))
    with pytest.raises(TensorShapeError, match="floating-point dtype, got I32"):
        load_vision_model(root)
    (root / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_vision_model(root)
    with pytest.raises(VisionConfigError, match="no vision_config"):
        load_vision_model(_write(tmp_path / "text_only", tensors, vision=None))
    with pytest.raises(TypeError, match="dtype"):
        load_vision_model(_write(tmp_path / "dtype", tensors), dtype=torch.int8)
    # an explicit config overrides config.json's, and must match the tensors
    with pytest.raises(TensorShapeError):
        load_vision_model(_write(tmp_path / "override", tensors), {**SMALL_K3, "vt_intermediate_size": 40})


def test_tiny_vision_tensors_are_seeded() -> None:
    a, raw = tiny_vision_tensors_and_config(64, seed=0)
    b, _ = tiny_vision_tensors_and_config(64, seed=0)
    c, _ = tiny_vision_tensors_and_config(64, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
    cfg = VisionConfig.from_hf_dict(raw)
    assert (cfg.norm_type, cfg.projector_type, cfg.pos_emb_interpolation_mode) == ("rmsnorm", "patchmergerv2",
                                                                                  "bilinear")
    assert cfg.qkv_hidden_size != cfg.hidden_size and not cfg.attn_bias and cfg.text_hidden_size == 64
    assert sum(t.numel() for t in a.values()) < 100_000


def test_make_tiny_vision(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "tiny"
    assert main(["make-tiny", str(root), "--vision", "--shards", "2"]) == 0
    assert "with a vision tower" in capsys.readouterr().out
    config = json.loads((root / "config.json").read_text())
    assert config["vision_config"]["text_hidden_size"] == config["text_config"]["hidden_size"] == 64
    assert config["image_placeholder"] == "<|kimi_image_placeholder|>"
    tokenizer = ByteTokenizer.from_dir(root)
    media = MediaTokens.from_lookup(tokenizer.special_tokens.get)  # the tiny tokenizer names K3's media tokens
    assert config["media_placeholder_token_id"] == media.pad
    load_model(root, dtype=torch.float32, progress=False)  # the text loader skips the vision tensors
    vision = load_vision_model(root, dtype=torch.float32)
    cfg = PreprocessConfig.from_dir(root)
    assert (cfg.in_patch_limit, cfg.patch_limit_on_one_side) == (1024, 32)
    image = preprocess_image(Image.new("RGBA", (2000, 1000), (9, 99, 199, 150)), cfg)
    assert image.num_tokens <= 256
    (emb,) = vision.encode_images([image])
    assert emb.shape == (image.num_tokens, 64) and torch.isfinite(emb).all()
    write_tiny_checkpoint(root)  # rewriting without --vision drops the tower's files
    assert not (root / "preprocessor_config.json").exists()
    assert "vision_config" not in json.loads((root / "config.json").read_text())
