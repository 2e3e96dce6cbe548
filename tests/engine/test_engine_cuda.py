"""cuda tier: the engine on an NVIDIA GPU with the Triton backend, whose KDA prefill saves intermediate states
only on the 64-token chunk grid (kda_save_grid=64). Prefix caching on and off must give identical greedy tokens
for a mix of shared-prefix requests (including a 1000-token shared prefix matched into the middle of a block),
with the cache invariants checked after every step."""

from __future__ import annotations

import pytest
import torch

from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from tests.engine.test_engine import _engine, _ids, _run

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny_k3_engine_cuda")
    write_tiny_checkpoint(root, seed=11)
    return load_model(root, dtype=torch.float32, device="cuda", backend="triton", progress=False)


def test_prefix_caching_on_off_identical_on_gpu_with_64_grid(gpu_model):
    vocab = gpu_model.cfg.vocab_size
    prefix = _ids(1000, 5, vocab)
    short = _ids(200, 6, vocab)
    requests = [
        ("long-a", prefix + [7, 8, 9], 0),
        ("long-b", prefix + [10], 2),  # matches 960 = 7.5 blocks of 128: mid-block copy
        ("short-a", short + [3], 0),
        ("short-b", short[:150] + [4, 5], 3),  # matches 128 (an alignment point)
        ("other", _ids(90, 7, vocab), 1),
    ]
    geometry = {"block": 128, "unit": 64, "align": 128, "grid": 64, "budget": 512, "num_blocks": 64}
    geometry.update(num_slots=32, max_len=1100)
    on_engine = _engine(gpu_model, True, **geometry)
    on = _run(on_engine, requests)
    off = _run(_engine(gpu_model, False, **geometry), requests)
    assert on == off
    stats = on_engine.stats()
    assert stats["hit_tokens"] >= 960 + 128 and stats["cow_copies"] >= 1, stats
