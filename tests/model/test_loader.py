"""Checkpoint loading: the released layouts, sharding, and the named errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_fixtures import one_thread, write_kimi_linear_checkpoint  # noqa: F401 (autouse)
from safetensors.torch import load_file, save_file

from rocm_k3.model.config import UnsupportedModelError
from rocm_k3.model.loader import (
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    load_model,
)
from simple_cache import SimpleCache
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.tokenizers.byte import EMBEDDED_VOCAB_SIZE

P = "language_model."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, dst)
    return dst


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    cache = SimpleCache(model.cfg, max_model_len=len(ids), dtype=model.dtype)
    return model.forward(cache.prepare([(0, ids)]), cache)


def _edit(root, fn) -> None:
    file = root / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_tiny_checkpoint_uses_released_k3_layout(tiny_dir) -> None:
    """Names and shapes as the public K3 loaders read them (language_model. prefix, compressed-tensors experts)."""
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    expected = {
        P + "model.embed_tokens.weight": ((EMBEDDED_VOCAB_SIZE, 64), torch.bfloat16),
        P + "lm_head.weight": ((EMBEDDED_VOCAB_SIZE, 64), torch.bfloat16),
        P + "model.output_attn_res_proj.weight": ((1, 64), torch.bfloat16),
        P + "model.layers.0.mlp.gate_proj.weight": ((128, 64), torch.bfloat16),
        P + "model.layers.0.self_attention_res_proj.weight": ((1, 64), torch.bfloat16),
        P + "model.layers.0.mlp_res_norm.weight": ((64,), torch.bfloat16),
        P + "model.layers.0.self_attn.q_conv1d.weight": ((64, 1, 4), torch.bfloat16),
        P + "model.layers.0.self_attn.A_log": ((32,), torch.float32),  # [head_dim], zero-padded past H = 2
        P + "model.layers.0.self_attn.dt_bias": ((64,), torch.float32),
        P + "model.layers.0.self_attn.g_proj.weight": ((64, 64), torch.bfloat16),  # full-rank KDA gate
        P + "model.layers.2.self_attn.q_a_proj.weight": ((32, 64), torch.bfloat16),
        P + "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": ((576, 64), torch.bfloat16),
        P + "model.layers.2.self_attn.kv_b_proj.weight": ((512, 512), torch.bfloat16),
        P + "model.layers.2.self_attn.g_proj.weight": ((256, 64), torch.bfloat16),  # MLA output gate
        P + "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": ((8,), torch.float32),
        P + "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": ((32, 64), torch.bfloat16),
        P + "model.layers.1.block_sparse_moe.routed_expert_norm.weight": ((32,), torch.bfloat16),
        P + "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": ((64, 64), torch.bfloat16),
        P + "model.layers.1.block_sparse_moe.experts.7.w1.weight_packed": ((32, 16), torch.uint8),
        P + "model.layers.1.block_sparse_moe.experts.7.w1.weight_scale": ((32, 1), torch.uint8),
        P + "model.layers.5.block_sparse_moe.experts.0.w2.weight_packed": ((32, 16), torch.uint8),
    }
    for name, (shape, dtype) in expected.items():
        assert name in tensors, name
        assert tuple(tensors[name].shape) == shape and tensors[name].dtype == dtype, name
    assert not any(".experts." in n and n.endswith(".weight") for n in tensors)  # experts only as MXFP4
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    size = sum(f.stat().st_size for f in tiny_dir.iterdir())
    assert size < 4_000_000, f"tiny checkpoint is {size} bytes"


def test_sharded_checkpoint_matches_single_file(tiny_dir, tmp_path) -> None:
    sharded = write_tiny_checkpoint(tmp_path / "sharded", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) == 3
    ids = list(b"shards")
    a = _last_logits(load_model(tiny_dir, dtype=torch.float32, progress=False), ids)
    b = _last_logits(load_model(sharded, dtype=torch.float32, progress=False), ids)
    assert torch.equal(a, b)


def test_kimi_linear_checkpoint_loads_in_bf16(tmp_path) -> None:
    write_kimi_linear_checkpoint(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    moe = model.layers[1].ffn
    assert moe.experts.fmt == "bf16" and moe.experts.w13.dtype == torch.bfloat16
    assert model.cfg.expert_format == "bf16" and not model.cfg.uses_attn_res
    logits = _last_logits(model, [5, 6, 7])
    assert logits.shape == (1, model.cfg.vocab_size) and torch.isfinite(logits).all()


def test_a_log_layouts_load_alike(tiny_dir, tiny_copy) -> None:
    """A_log as released in K3 ([D], padded) and as transformers writes it ([1, 1, H, 1]) give the same model."""
    name = P + "model.layers.4.self_attn.A_log"
    _edit(tiny_copy, lambda t: t.update({name: t[name][:2].reshape(1, 1, 2, 1).contiguous()}))
    ids = list(b"A_log")
    a = _last_logits(load_model(tiny_dir, dtype=torch.float32, progress=False), ids)
    b = _last_logits(load_model(tiny_copy, dtype=torch.float32, progress=False), ids)
    assert torch.equal(a, b)
    _edit(tiny_copy, lambda t: t.update({name: torch.zeros(3)}))
    with pytest.raises(TensorShapeError, match=r"A_log: expected shape \[1, 1, 2, 1\] or \[2\] or \[32\], got \[3\]"):
        load_model(tiny_copy, progress=False)


def test_a_log_padding_must_be_zero(tiny_copy) -> None:
    """The [D] layout carries H values then zeros; a non-zero tail is another layout and is refused, not dropped."""
    name = P + "model.layers.4.self_attn.A_log"
    _edit(tiny_copy, lambda t: t.update({name: torch.cat([t[name][:2], torch.full((30,), 0.5)])}))
    with pytest.raises(TensorShapeError, match=r"layers\.4\.self_attn\.A_log: a \[32\] A_log must hold the 2 "
                                               r"per-head values followed by zero padding .* 30 of the 30"):
        load_model(tiny_copy, progress=False)


def test_vision_tensors_are_ignored(tiny_copy) -> None:
    _edit(tiny_copy, lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3)}))
    load_model(tiny_copy, dtype=torch.float32, progress=False)


def test_missing_tensor(tiny_copy) -> None:
    name = P + "model.layers.4.self_attn.dt_bias"
    _edit(tiny_copy, lambda t: t.pop(name))
    with pytest.raises(MissingTensorError, match=name.replace(".", r"\.")):
        load_model(tiny_copy, progress=False)


def test_unexpected_tensor(tiny_copy) -> None:
    name = P + "model.layers.0.self_attn.k_norm.weight"
    _edit(tiny_copy, lambda t: t.update({name: torch.ones(64)}))
    with pytest.raises(UnexpectedTensorError, match=name.replace(".", r"\.")):
        load_model(tiny_copy, progress=False)


def test_wrong_shape(tiny_copy) -> None:
    name = P + "model.layers.2.self_attn.kv_b_proj.weight"
    _edit(tiny_copy, lambda t: t.update({name: torch.zeros(256, 512, dtype=torch.bfloat16)}))
    with pytest.raises(TensorShapeError, match=r"kv_b_proj\.weight: expected shape \[512, 512\], got \[256, 512\]"):
        load_model(tiny_copy, progress=False)


def test_packed_expert_must_be_uint8(tiny_copy) -> None:
    name = P + "model.layers.3.block_sparse_moe.experts.2.w3.weight_packed"
    _edit(tiny_copy, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(TensorShapeError, match=r"w3\.weight_packed: expected dtype uint8"):
        load_model(tiny_copy, progress=False)


@pytest.mark.parametrize("proj,which", [("w3", "w13"), ("w2", "w2")])
def test_nan_expert_scale_byte_is_refused(tiny_copy, proj: str, which: str) -> None:
    """An E8M0 0xFF (NaN) scale byte in a routed expert: named at load (the fast paths would decode it as 2^127)."""
    name = P + f"model.layers.3.block_sparse_moe.experts.5.{proj}.weight_scale"

    def poison(t) -> None:
        t[name] = t[name].clone()
        t[name][1, 0] = 0xFF

    _edit(tiny_copy, poison)
    with pytest.raises(CorruptCheckpointError, match=rf"layers\.3\..*experts: 1 E8M0 scale byte\(s\) of the {which} "):
        load_model(tiny_copy, progress=False)


def test_unsupported_model_type(tiny_copy) -> None:
    config = json.loads((tiny_copy / "config.json").read_text())
    config["model_type"] = "deepseek_v3"
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="deepseek_v3"):
        load_model(tiny_copy, progress=False)


@pytest.mark.parametrize("damage", ["truncated", "garbage-header"])
def test_corrupt_safetensors(tiny_copy, damage: str) -> None:
    file = tiny_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + data[24:])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_model(tiny_copy, progress=False)


def test_index_naming_a_missing_shard(tmp_path) -> None:
    root = write_tiny_checkpoint(tmp_path / "sharded", shards=2)
    next(iter(sorted(root.glob("model-*.safetensors")))).unlink()
    with pytest.raises(CorruptCheckpointError, match="do not exist"):
        load_model(root, progress=False)
