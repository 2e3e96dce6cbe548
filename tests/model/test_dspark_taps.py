"""What a DSpark drafter reads (``KimiModel.tap_outputs``): the residual stream after each named layer at every
token row. K3 (AttnRes): the current block's partial sum p after the layer, against the independent forward of
test_model_forward; Kimi Linear (plain residual): transformers' ``hidden_states[i + 1]`` (the output of layer i)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel, seeded
from model_fixtures import KL_VOCAB, one_thread, write_kimi_linear_checkpoint  # noqa: F401 (autouse)
from test_model_forward import full_logits, naive_k3_logits

from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint

TOL = 1e-4


def test_k3_taps_are_the_block_partial_sums_after_the_layers(tmp_path) -> None:
    root = write_tiny_checkpoint(tmp_path, seed=3)
    model = load_model(root, dtype=torch.float32, progress=False)
    ids = torch.randint(0, model.cfg.vocab_size, (9,), generator=seeded(21)).tolist()
    streams: list[torch.Tensor] = []
    naive_k3_logits(root, ids, streams)
    taps = (0, 1, 2, 4, 5)  # around the AttnRes block boundaries (block size 2) and the last layer
    model.tap_layers, model.tap_outputs = taps, True
    full_logits(model, ids)
    assert model.tapped.shape == (len(ids), len(taps), model.cfg.hidden_size)
    for j, i in enumerate(taps):
        assert_rel(model.tapped[:, j], streams[i], TOL, f"K3 stream after layer {i}")


@pytest.mark.slow  # ~28 s on 2 cores (transformers' Kimi Linear on the CPU); the K3 test above checks the same taps
def test_kimi_linear_taps_are_the_layer_outputs(tmp_path) -> None:
    hf = write_kimi_linear_checkpoint(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    ids = torch.randint(0, KL_VOCAB, (10,), generator=seeded(22))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states
    taps = (0, 2, 3)
    model.tap_layers, model.tap_outputs = taps, True
    full_logits(model, ids.tolist())
    for j, i in enumerate(taps):
        assert_rel(model.tapped[:, j], ref[i + 1][0], TOL, f"Kimi Linear output of layer {i}")
