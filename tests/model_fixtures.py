"""Shared pieces of the model tests: a tiny Kimi Linear checkpoint written by transformers' own
``save_pretrained``, and the single-thread fixture.

transformers >= 5 ships ``KimiLinearForCausalLM`` (the ``test`` extra installs it); its forward pass is an
independent formulation of the Kimi Linear variant (softplus gate, low-rank output gate, no q_lora, SiLU, plain
residual, bf16/fp32 experts, routed_scaling_factor 2.446). Weights are re-drawn with O(1) activations so every
sublayer matters in a comparison.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

KL_VOCAB = 300
KL_LAYERS = 5  # KDA at 1, 3, 4 and MLA at 2, 5 (1-based): two KDA/MLA boundaries


# A latent geometry no release uses (K3 and Kimi Linear: kv_lora_rank 512, nope 128, rope 64, v 128)
SMALL_MLA_GEOMETRY = {"kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


def kimi_linear_hf_model(seed: int = 0, **overrides):
    """A tiny transformers KimiLinearForCausalLM in eval mode, fp32, with seeded O(1) weights.

    ``overrides`` replace KimiLinearConfig arguments (e.g. ``SMALL_MLA_GEOMETRY`` or ``rms_norm_eps``).
    """
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM")
    args = dict(
        vocab_size=KL_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=KL_LAYERS, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
        routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, num_experts=8, num_experts_per_tok=2, num_local_experts=8,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                            "full_attn_layers": [2, 5], "kda_layers": [1, 3, 4]},
        first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    args.update(overrides)
    cfg = transformers.KimiLinearConfig(**args)
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep the released initialisation (decay rates in a sensible range)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def write_kimi_linear_checkpoint(directory: Path, seed: int = 0, **overrides):
    """Save the tiny model with ``save_pretrained`` (released Kimi Linear tensor names); returns the HF model."""
    model = kimi_linear_hf_model(seed, **overrides)
    model.save_pretrained(str(directory))
    return model


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens from transformers' own forward pass (full recompute each step, no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add synchronisation (seconds per step on a loaded 2-core machine).

    Autouse in every module that imports it.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def default_sigint():
    """SIGINT raises KeyboardInterrupt for this test (``signal.default_int_handler``), whatever handler an earlier
    test in the same pytest process left installed; the previous handler is restored afterwards. (In the full CI
    run some earlier test leaves a non-default handler behind; the cause is not found yet.)"""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield previous
    finally:
        signal.signal(signal.SIGINT, previous)


def nan_embedding_checkpoint(ckpt: Path, directory: Path, token_id: int = 42) -> Path:
    """A copy of the checkpoint ``ckpt`` in ``directory`` whose embedding row ``token_id`` is NaN: any sequence
    holding that token gets NaN logits from the model (a broken model, not a sampling extreme)."""
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (directory / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    tensors[name][token_id] = float("nan")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
