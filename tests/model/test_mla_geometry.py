"""Kimi Linear checkpoints written by transformers, against transformers' own forward pass, for the facts a loader
can get wrong without any shape error:

- an MLA latent geometry no release uses (kv_lora_rank 32, nope 32, rope 16, v 32): rocm-k3 takes every width from
  the config and the shapes, so the 32 greedy tokens are transformers' and every teacher-forced logit is within
  1e-4 (fp32 both sides; they differ in summation order only, as in tests/model/test_model_forward.py);
- the eps of q_a_layernorm / kv_a_layernorm: transformers builds them with KimiLinearRMSNorm's default 1e-6, not
  rms_norm_eps. With rms_norm_eps = 0.1 the logits match only with that choice: the test also runs the model with
  rms_norm_eps in those two norms and requires it to miss transformers by far more than the tolerance;
- A_log: transformers stores [1, 1, H, 1]; the [H] layout of the same values gives the same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_rel, rel_err, seeded
from model_fixtures import (  # noqa: F401 (one_thread: autouse)
    KL_VOCAB,
    SMALL_MLA_GEOMETRY,
    hf_greedy,
    one_thread,
    write_kimi_linear_checkpoint,
)
from safetensors.torch import load_file, save_file

import rocm_k3
from rocm_k3.model import mla as model_mla
from rocm_k3.model.loader import load_model
from simple_cache import SimpleCache

LOGITS_TOL = 1e-4
STEPS = 32
PROMPT = [5, 17, 42, 99, 250, 7, 7, 131]


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids``, logits of every position [T, vocab]."""
    cache = SimpleCache(model.cfg, max_model_len=len(ids), dtype=model.dtype)
    batch = cache.prepare([(0, ids)])
    batch.logits_indices = torch.arange(len(ids))
    return model.forward(batch, cache)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def small_geometry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, list[int]]:
    """The checkpoint, the transformers model and transformers' 32 greedy tokens after PROMPT."""
    path = tmp_path_factory.mktemp("kl-small-mla")
    hf = write_kimi_linear_checkpoint(path, seed=4, **SMALL_MLA_GEOMETRY)
    return path, hf, hf_greedy(hf, PROMPT, STEPS)


def test_small_mla_geometry_greedy_matches_transformers(small_geometry) -> None:
    path, hf, want = small_geometry
    llm = rocm_k3.LLM(path, dtype="float32", backend="reference")
    assert (llm.config.kv_lora_rank, llm.config.qk_rope_head_dim, llm.config.qk_nope_head_dim,
            llm.config.v_head_dim) == (32, 16, 32, 32)
    assert llm.model.layers[1].attn.kv_b.weight.shape == (2 * (32 + 32), 32)
    out = llm.generate(PROMPT, rocm_k3.SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))[0]
    assert out.token_ids == want, f"greedy tokens differ:\nrocm-k3      {out.token_ids}\ntransformers {want}"
    seq = PROMPT + want
    assert_rel(full_logits(llm.model, seq), hf_logits(hf, seq), LOGITS_TOL, "teacher-forced logits")


def test_mla_norm_eps_is_transformers_default_not_rms_norm_eps(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    hf = write_kimi_linear_checkpoint(tmp_path, seed=5, rms_norm_eps=0.1, **SMALL_MLA_GEOMETRY)
    ids = torch.randint(0, KL_VOCAB, (13,), generator=seeded(13)).tolist()
    ref = hf_logits(hf, ids)
    assert hf.model.layers[1].self_attn.kv_a_layernorm.variance_epsilon == 1e-6  # what transformers builds
    assert hf.model.layers[1].input_layernorm.variance_epsilon == 0.1
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    assert_rel(full_logits(model, ids), ref, LOGITS_TOL, "logits with rms_norm_eps = 0.1")
    monkeypatch.setattr(model_mla, "MLA_NORM_EPS", model.cfg.rms_norm_eps)  # the other engines' choice
    wrong = rel_err(full_logits(load_model(tmp_path, dtype=torch.float32, progress=False), ids), ref)
    assert wrong > 100 * LOGITS_TOL, f"rms_norm_eps in the MLA norms misses transformers by only {wrong:.2e}"


def test_a_log_as_heads_vector_loads_alike(tmp_path: Path) -> None:
    hf = write_kimi_linear_checkpoint(tmp_path, seed=6, **SMALL_MLA_GEOMETRY)
    ids = list(range(3, 40, 3))
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.self_attn.A_log"
    assert tuple(tensors[name].shape) == (1, 1, 2, 1)  # transformers' layout
    assert_rel(full_logits(load_model(tmp_path, dtype=torch.float32, progress=False), ids), hf_logits(hf, ids),
               LOGITS_TOL, "logits, A_log [1, 1, H, 1]")
    tensors = {k: (v.reshape(-1).contiguous() if k.endswith("A_log") else v) for k, v in tensors.items()}
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert_rel(full_logits(load_model(tmp_path, dtype=torch.float32, progress=False), ids), hf_logits(hf, ids),
               LOGITS_TOL, "logits, A_log [H]")
