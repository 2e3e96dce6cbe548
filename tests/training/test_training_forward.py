"""The training forward (``rocm_k3.training.forward``) computes the serving model's prefill, and autograd reaches
every trained tensor.

Parity is checked on the logits of every position against ``KimiModel.hidden_states`` (reference ops, fp32,
SimpleCache prefill of each row): the committed trained embedded model, a random tiny K3 and a Kimi Linear model
written by transformers (plain residual, softplus gate, low-rank output gate, no q_lora, SiLU, bf16 experts).
Tolerance 1e-5 relative (fp32; measured ~1.5e-6: the chunk lengths and summation orders differ).
The chunked delta rule is checked against the token-by-token recurrence of ``rocm_k3.ops.kda.naive`` in fp64,
through both of its intra-chunk paths (factored exponentials, explicit pairwise decay).
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
from rocm_k3.ops.kda.naive import kda_recurrent_naive
from rocm_k3.training.delta_rule import chunked_delta_rule
from rocm_k3.training.forward import forward_logits
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
    out = forward_logits(cfg, params, ids)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= PARITY_TOL


def test_training_forward_matches_kimi_model_kimi_linear(tmp_path) -> None:
    write_kimi_linear_checkpoint(tmp_path)
    cfg, params = load_params(tmp_path)
    assert not cfg.uses_attn_res and cfg.kda.gate_lower_bound is None
    ids = _ids(cfg.vocab_size, 2, 70, seed=2)
    assert rel_err(forward_logits(cfg, params, ids), _serving_logits(tmp_path, ids)) <= PARITY_TOL


def test_gradients_reach_every_trained_tensor(tmp_path) -> None:
    cfg, params = load_params(write_tiny_checkpoint(tmp_path, seed=4))
    params = {n: t.requires_grad_(is_trainable(n)) for n, t in params.items()}
    ids = _ids(cfg.vocab_size, 2, 40, seed=5)
    logits = forward_logits(cfg, params, ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)).backward()
    for name, t in params.items():
        if not t.requires_grad:
            assert name.endswith("e_score_correction_bias"), name
            continue
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        if name.endswith("A_log"):  # K3 pads A_log to head_dim with zeros that the model never reads
            assert t.grad[:cfg.kda.num_heads].abs().sum() > 0, name
        elif ".layers.0.self_attention_res_" in name:  # layer 0's input mixes one source: the weight is 1
            assert t.grad.abs().sum() == 0, name
        elif ".experts." not in name:  # an expert no token was routed to this batch legitimately gets zero
            assert t.grad.abs().sum() > 0, name


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("decay", ["safe_gate", "steep"])
def test_chunked_delta_rule_matches_recurrence(chunk: int, decay: str) -> None:
    """``safe_gate``: g in (-5, 0), the factored products for chunks up to 16; ``steep``: g down to -12 per
    token, beyond the factored range for any chunk > 6, so the pairwise path runs."""
    gen = torch.Generator().manual_seed(chunk)
    b, length, h, k, v = 2, 37, 2, 32, 16
    q = F.normalize(torch.randn(b, length, h, k, generator=gen), dim=-1) * k ** -0.5
    key = F.normalize(torch.randn(b, length, h, k, generator=gen), dim=-1)
    val = torch.randn(b, length, h, v, generator=gen)
    low = -5.0 if decay == "safe_gate" else -12.0
    g = low * torch.rand(b, length, h, k, generator=gen)
    beta = torch.rand(b, length, h, generator=gen)
    out = chunked_delta_rule(q, key, val, g, beta, chunk)
    assert out.shape == (b, length, h, v) and out.dtype == torch.float32
    for i in range(b):
        ref, _ = kda_recurrent_naive(q[i].double(), key[i].double(), val[i].double(), g[i].double(),
                                     beta[i].double(), 1.0)
        assert rel_err(out[i], ref) <= 1e-5


def test_chunked_delta_rule_rejects_a_bad_chunk() -> None:
    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="chunk"):
        chunked_delta_rule(x, x, x, x, torch.zeros(1, 4, 1), chunk=0)
