"""The training forward (``rocm_k3.training.forward``: the serving model's modules, trained in place) computes the
serving model's prefill, and autograd reaches every trained tensor.

Parity is checked on the logits of every position against ``KimiModel.hidden_states`` run as the server runs it
(inference mode, reference ops, fp32, one SimpleCache prefill per row): the committed trained embedded model, a
random tiny K3 and a Kimi Linear model written by transformers (plain residual, softplus gate, low-rank output
gate, no q_lora, SiLU, bf16 experts). The training side differs in what the comparison is about: every row in one
batch over its own pools, dense experts loaded from the MXFP4 bytes, the graph recorded. Tolerance 1e-5 relative
(fp32; measured 3e-8). The tensors round-trip through the model by checkpoint name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err
from model_fixtures import one_thread, write_kimi_linear_checkpoint  # noqa: F401 (autouse)

from rocm_k3.model.loader import load_model
from simple_cache import SimpleCache
from rocm_k3.model.tiny import EMBEDDED_DIR, write_tiny_checkpoint
from rocm_k3.training.forward import checkpoint_tensors_of, forward_logits, training_model
from rocm_k3.training.params import is_trainable, load_params

PARITY_TOL = 1e-5


def _serving_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """Logits fp32 [B, L, vocab] of every position, one SimpleCache prefill per row (reference ops)."""
    model = load_model(path, dtype=torch.float32, backend="reference", progress=False)
    rows = []
    for row in ids:
        cache = SimpleCache(model.cfg, max_model_len=ids.shape[1], dtype=torch.float32)
        batch = cache.prepare([(0, row.tolist())])
        with torch.inference_mode():
            rows.append(model.lm_head(model.hidden_states(batch, cache)).float())
    return torch.stack(rows)


def _ids(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("which", ["embedded", "random_tiny"])
def test_training_forward_matches_kimi_model_k3(tmp_path, which: str) -> None:
    path = EMBEDDED_DIR if which == "embedded" else write_tiny_checkpoint(tmp_path, seed=3)
    cfg, params = load_params(path)
    ids = _ids(cfg.vocab_size, 2, 150, seed=1)  # 150: several KDA chunks, a ragged last one
    if which == "embedded":  # text the trained model knows, so its logits are far from flat
        ids[0, :60] = torch.tensor(list(b"Return the number of items in the sequence, or raise an error."[:60]))
    ref = _serving_logits(path, ids)
    model = training_model(cfg, params)
    back = checkpoint_tensors_of(model)
    assert back.keys() == params.keys() and all(torch.equal(back[n], params[n]) for n in params)
    out = forward_logits(model, ids)
    assert out.shape == ref.shape and out.requires_grad
    assert rel_err(out, ref) <= PARITY_TOL


def test_training_forward_matches_kimi_model_kimi_linear(tmp_path) -> None:
    write_kimi_linear_checkpoint(tmp_path)
    cfg, params = load_params(tmp_path)
    assert not cfg.uses_attn_res and cfg.kda.gate_lower_bound is None
    ids = _ids(cfg.vocab_size, 2, 70, seed=2)
    assert rel_err(forward_logits(training_model(cfg, params), ids), _serving_logits(tmp_path, ids)) <= PARITY_TOL


def test_gradients_reach_every_trained_tensor(tmp_path) -> None:
    cfg, params = load_params(write_tiny_checkpoint(tmp_path, seed=4))
    model = training_model(cfg, params)
    ids = _ids(cfg.vocab_size, 2, 40, seed=5)
    logits = forward_logits(model, ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)).backward()
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(name.endswith("ffn.bias") for name in frozen), frozen  # the router's selection bias
    for name, g in checkpoint_tensors_of(model, grads=True).items():
        assert torch.isfinite(g).all(), name
        if not is_trainable(name):
            assert g.abs().sum() == 0, name
        elif name.endswith("A_log"):  # K3 pads A_log to head_dim with zeros that the model never reads
            assert g[:cfg.kda.num_heads].abs().sum() > 0, name
        elif ".layers.0.self_attention_res_" in name:  # layer 0's input mixes one source: the weight is 1
            assert g.abs().sum() == 0, name
        elif ".experts." not in name:  # an expert no token was routed to this batch legitimately gets zero
            assert g.abs().sum() > 0, name


def test_training_forward_rejects_bad_ids(tmp_path) -> None:
    cfg, params = load_params(write_tiny_checkpoint(tmp_path, seed=4))
    with pytest.raises(ValueError, match="input_ids"):
        forward_logits(training_model(cfg, params), torch.zeros(4, dtype=torch.int64))
