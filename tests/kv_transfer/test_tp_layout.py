"""The TP-1 wire layout of KDA state: shards merged by a TP-2 producer equal a TP-1 model's state, and a TP-2
consumer's cut of it equals each rank's own shard (q | k | v heads of the conv state kept apart)."""

from __future__ import annotations

import pytest
import torch

from rocm_k3.kv_transfer.tp_layout import TPShard, merge_heads, split_heads

H, D, W = 4, 3, 4


def _full():
    rec = torch.arange(H * D * D, dtype=torch.float32).reshape(H, D, D)  # [H, K, V]
    conv = torch.arange(3 * H * D * (W - 1), dtype=torch.float32).reshape(3 * H * D, W - 1)  # [3 H K, W-1]
    return rec, conv


def _shard(conv: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """What a TP rank's conv pool holds: its heads' rows of q, then of k, then of v (the model's layout)."""
    hl = H // tp
    return torch.cat([conv[i * H * D + rank * hl * D : i * H * D + (rank + 1) * hl * D] for i in range(3)])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merge_and_split_are_inverse_and_match_the_model_layout(tp):
    rec, conv = _full()
    rec_shards = [rec[r * H // tp : (r + 1) * H // tp] for r in range(tp)]
    conv_shards = [_shard(conv, r, tp) for r in range(tp)]
    assert torch.equal(merge_heads("kda.0.recurrent", rec_shards), rec)
    assert torch.equal(merge_heads("kda.0.conv", conv_shards), conv)
    for r in range(tp):
        assert torch.equal(split_heads("kda.0.recurrent", rec, r, tp), rec_shards[r])
        assert torch.equal(split_heads("kda.0.conv", conv, r, tp), conv_shards[r])


def test_split_names_heads_that_do_not_divide_and_unknown_names():
    rec, conv = _full()
    with pytest.raises(ValueError, match="does not split over 3"):
        split_heads("kda.0.recurrent", rec, 0, 3)
    with pytest.raises(ValueError, match="not a KDA state name"):
        split_heads("mla.0", rec, 0, 2)
    with pytest.raises(ValueError, match="needs a process group"):
        TPShard(0, 2)
    with pytest.raises(ValueError, match="out of range"):
        TPShard(2, 2, group=object())
