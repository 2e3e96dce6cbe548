"""ForwardBatch validation and the SimpleCache side of the HybridCacheView interface."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rocm_k3.model.config import ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from simple_cache import SimpleCache
from rocm_k3.model.tiny import tiny_config


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_config())


def test_simple_cache_implements_the_view(cfg: ModelConfig) -> None:
    cache = SimpleCache(cfg, max_seqs=2, max_model_len=10, block_size=4, spare_slots=1, dtype=torch.float32)
    assert isinstance(cache, HybridCacheView)
    pages = 2 * 3  # 2 sequences x ceil(10 / 4) pages, + the pools' scratch page for padded graph rows
    assert cache.mla_kv(1).shape == (pages + 1, 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    h, d, w = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size
    assert cache.kda_state(3).shape == (4, h, d, d) and cache.kda_state(3).dtype == torch.float32
    assert cache.conv_state(0).shape == (4, 3 * h * d, w - 1)


def test_cache_latent_width_follows_the_config() -> None:
    small = ModelConfig.from_hf_dict(tiny_config({"kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
                                                  "v_head_dim": 32}))
    cache = SimpleCache(small, max_model_len=5, block_size=4, dtype=torch.float32)
    assert small.mla_latent_width == 48 and cache.mla_kv(0).shape[-1] == 48


def test_prepare_builds_the_step(cfg: ModelConfig) -> None:
    cache = SimpleCache(cfg, max_seqs=2, max_model_len=10, block_size=4, dtype=torch.float32)
    first = cache.prepare([(1, [5, 6, 7]), (0, [8, 9])])
    assert first.cu_seqlens.tolist() == [0, 3, 5] and first.seq_lens.tolist() == [3, 2]
    assert first.positions.tolist() == [0, 1, 2, 0, 1]
    assert first.slot_mapping.tolist() == [12, 13, 14, 0, 1]  # sequence 1 owns pages 3..5 (slots 12..23)
    assert first.block_table.tolist() == [[3, 4, 5], [0, 1, 2]]
    assert first.kda_slots.tolist() == [1, 0] and first.has_initial_state.tolist() == [False, False]
    assert first.logits_indices.tolist() == [2, 4] and not first.is_decode
    step = cache.prepare([(0, [1]), (1, [2])])
    assert step.is_decode and step.positions.tolist() == [2, 3] and step.has_initial_state.all()


def test_prepare_errors(cfg: ModelConfig) -> None:
    cache = SimpleCache(cfg, max_model_len=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="exceed max_model_len=4"):
        cache.prepare([(0, [1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="no new tokens"):
        cache.prepare([(0, [])])
    with pytest.raises(ValueError, match="seq: expected 0..0"):
        cache.prepare([(1, [1])])


def _valid() -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.tensor([1, 2, 3]), positions=torch.tensor([0, 1, 0]),
        cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32), seq_lens=torch.tensor([2, 1], dtype=torch.int32),
        block_table=torch.zeros(2, 1, dtype=torch.int32), slot_mapping=torch.tensor([0, 1, 16]),
        kda_slots=torch.tensor([0, 1], dtype=torch.int32), has_initial_state=torch.zeros(2, dtype=torch.bool),
        logits_indices=torch.tensor([1, 2]),
    )


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32)}, TypeError, "input_ids: expected dtype torch.int64"),
        ({"positions": torch.tensor([0, 1])}, ValueError, r"positions: expected shape \(3,\)"),
        ({"seq_lens": torch.tensor([2], dtype=torch.int32)}, ValueError, r"seq_lens: expected shape \(2,\)"),
        ({"kda_slots": torch.tensor([0, 1])}, TypeError, "kda_slots: expected dtype torch.int32"),
        ({"block_table": torch.zeros(3, 1, dtype=torch.int32)}, ValueError, "block_table"),
        ({"save_positions": torch.tensor([[0, 1]], dtype=torch.int32)}, ValueError, "both be given"),
        ({"save_positions": torch.tensor([[0, 1, 2]], dtype=torch.int32),
          "save_slots": torch.tensor([2], dtype=torch.int32)}, ValueError, r"\[M, 2\]"),
        ({"is_decode": True}, ValueError, "is_decode"),
    ],
    ids=["ids-dtype", "positions-len", "seq-lens-len", "slots-dtype", "block-table-rows", "save-without-slots",
         "save-rows", "decode-with-prefill"],
)
def test_forward_batch_validation(changes: dict, error: type, match: str) -> None:
    fields = {f.name: getattr(_valid(), f.name) for f in dataclasses.fields(ForwardBatch)}
    fields.update(changes)
    with pytest.raises(error, match=match):
        ForwardBatch(**fields)
