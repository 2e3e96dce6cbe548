"""The full model against independent formulations, for both variants.

- Kimi K3 (tiny K3 checkpoint: safe gate, full-rank gate, q_lora, MLA output gate, LatentMoE, SiTU, AttnRes,
  MXFP4 experts) against a naive token-by-token reimplementation written here from K3_SPEC in plain torch.
- Kimi Linear (tiny checkpoint written by transformers) against transformers' own forward pass.
Tolerance: fp32 everywhere, relative error 1e-4 on the logits of every position (the two sides only differ in
summation order: chunked vs recurrent KDA, fused vs separate projections).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel, seeded
from model_fixtures import KL_VOCAB, one_thread, write_kimi_linear_checkpoint  # noqa: F401 (autouse)
from safetensors.torch import load_file

from rocm_k3.model.loader import load_model
from simple_cache import SimpleCache
from rocm_k3.model.tiny import write_tiny_checkpoint

LOGITS_TOL = 1e-4


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("k3"), seed=3)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` in a fresh cache, logits of every position [T, vocab]."""
    cache = SimpleCache(model.cfg, max_model_len=len(ids), dtype=model.dtype)
    batch = cache.prepare([(0, ids)])
    batch.logits_indices = torch.arange(len(ids))
    return model.forward(batch, cache)


# --------------------------------------------------------------------------------------------------------
# An independent K3 forward pass (one sequence, no cache), straight from K3_SPEC sections 2-6.
# --------------------------------------------------------------------------------------------------------
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_to_float(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[out, in/2] codes (low nibble first) and [out, in/32] E8M0 scales -> fp32 [out, in]."""
    table = torch.tensor(_E2M1 + [-v for v in _E2M1])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    scale = torch.pow(2.0, scales.float() - 127.0).repeat_interleave(32, dim=1)
    return table[codes] * scale


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _situ(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)


def naive_k3_logits(ckpt_dir, ids: list[int], streams: list | None = None) -> torch.Tensor:
    """The logits [T, vocab]; ``streams``, if given, receives the stream after each layer (the block partial sum
    p, what a DSpark drafter taps)."""
    text = json.loads((ckpt_dir / "config.json").read_text())["text_config"]
    raw = {k: v.float() for k, v in load_file(str(ckpt_dir / "model.safetensors")).items()
           if not k.endswith(("weight_packed", "weight_scale"))}
    packed = load_file(str(ckpt_dir / "model.safetensors"))

    def W(name: str) -> torch.Tensor:
        return raw["language_model." + name]

    def expert(prefix: str) -> torch.Tensor:
        return _mxfp4_to_float(packed["language_model." + prefix + ".weight_packed"],
                               packed["language_model." + prefix + ".weight_scale"])

    eps, T = text["rms_norm_eps"], len(ids)
    lin = text["linear_attn_config"]
    H, D = lin["num_heads"], lin["head_dim"]
    mla_layers = {i - 1 for i in lin["full_attn_layers"]}

    def kda(l: int, x: torch.Tensor) -> torch.Tensor:
        a = f"model.layers.{l}.self_attn."

        def conv(name: str) -> torch.Tensor:
            y = x @ W(a + f"{name}_proj.weight").T  # [T, HD]
            w = W(a + f"{name}_conv1d.weight")  # [HD, 1, W]
            y = F.conv1d(F.pad(y.T[None], (w.shape[-1] - 1, 0)), w, groups=y.shape[1])[0].T
            return F.silu(y).view(T, H, D)

        q, k, v = conv("q"), conv("k"), conv("v")
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        f = (x @ W(a + "f_a_proj.weight").T @ W(a + "f_b_proj.weight").T).view(T, H, D)
        a_log = W(a + "A_log")[:H].view(H, 1)  # released K3 layout: [D], the H real entries first
        g = lin["gate_lower_bound"] * torch.sigmoid(torch.exp(a_log) * (f + W(a + "dt_bias").view(H, D)))
        beta = torch.sigmoid(x @ W(a + "b_proj.weight").T)  # [T, H]
        S = torch.zeros(H, D, D)
        o = torch.zeros(T, H, D)
        for t in range(T):
            S = S * torch.exp(g[t])[:, :, None]
            u = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
            S = S + beta[t][:, None, None] * k[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])
        gate = (x @ W(a + "g_proj.weight").T).view(T, H, D)
        y = _rms(o, W(a + "o_norm.weight"), eps) * torch.sigmoid(gate)
        return y.reshape(T, H * D) @ W(a + "o_proj.weight").T

    def mla(l: int, x: torch.Tensor) -> torch.Tensor:
        a = f"model.layers.{l}.self_attn."
        nh, r, pe = text["num_attention_heads"], text["kv_lora_rank"], text["qk_rope_head_dim"]
        dn, dv = text["qk_nope_head_dim"], text["v_head_dim"]
        q = _rms(x @ W(a + "q_a_proj.weight").T, W(a + "q_a_layernorm.weight"), 1e-6) @ W(a + "q_b_proj.weight").T
        q = q.view(T, nh, dn + pe)
        kv = x @ W(a + "kv_a_proj_with_mqa.weight").T
        c, k_pe = _rms(kv[:, :r], W(a + "kv_a_layernorm.weight"), 1e-6), kv[:, r:]
        kvb = (c @ W(a + "kv_b_proj.weight").T).view(T, nh, dn + dv)
        k = torch.cat([kvb[..., :dn], k_pe[:, None].expand(T, nh, pe)], dim=-1)
        scores = torch.einsum("thd,shd->hts", q, k) * (dn + pe) ** -0.5
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), kvb[..., dn:]).reshape(T, nh * dv)
        out = out * torch.sigmoid(x @ W(a + "g_proj.weight").T)
        return out @ W(a + "o_proj.weight").T

    def mlp(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return _situ(x @ W(prefix + "gate_proj.weight").T, x @ W(prefix + "up_proj.weight").T) @ \
            W(prefix + "down_proj.weight").T

    def moe(l: int, x: torch.Tensor) -> torch.Tensor:
        m = f"model.layers.{l}.block_sparse_moe."
        s = torch.sigmoid(x @ W(m + "gate.weight").T)  # [T, E]
        chosen = torch.topk(s + W(m + "gate.e_score_correction_bias"), text["num_experts_per_token"]).indices
        weights = s.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * text["routed_scaling_factor"]
        z = x @ W(m + "routed_expert_down_proj.weight").T  # [T, latent]
        r = torch.zeros_like(z)
        for t in range(T):
            for j in range(chosen.shape[1]):
                e = f"model.layers.{l}.block_sparse_moe.experts.{int(chosen[t, j])}."
                h = _situ(z[t] @ expert(e + "w1").T, z[t] @ expert(e + "w3").T)
                r[t] += weights[t, j] * (h @ expert(e + "w2").T)
        r = _rms(r, W(m + "routed_expert_norm.weight"), eps) @ W(m + "routed_expert_up_proj.weight").T
        return r + mlp(m + "shared_experts.", x)

    def mix(p: torch.Tensor, blocks: list[torch.Tensor], site: str) -> torch.Tensor:
        sources = torch.stack(blocks + [p])  # [n+1, T, hidden]
        logit = (_rms(sources, W(site + "_norm.weight"), eps) * W(site + "_proj.weight").view(-1)).sum(-1)
        return (logit.softmax(0)[..., None] * sources).sum(0)

    block = text["attn_res_block_size"]
    blocks: list[torch.Tensor] = []
    p: torch.Tensor | None = W("model.embed_tokens.weight")[ids]
    for l in range(text["num_hidden_layers"]):
        pre = f"model.layers.{l}."
        x = mix(p, blocks[:math.ceil(l / block)], pre + "self_attention_res")
        if l % block == 0:
            blocks.append(p)
            p = None
        xin = _rms(x, W(pre + "input_layernorm.weight"), eps)
        a = mla(l, xin) if l in mla_layers else kda(l, xin)
        p = a if p is None else p + a
        x = _rms(mix(p, blocks, pre + "mlp_res"), W(pre + "post_attention_layernorm.weight"), eps)
        p = p + (mlp(pre + "mlp.", x) if l < text["first_k_dense_replace"] else moe(l, x))
        if streams is not None:
            streams.append(p)
    h = mix(p, blocks, "model.output_attn_res")
    return _rms(h, W("model.norm.weight"), eps) @ W("lm_head.weight").T


def test_k3_matches_naive_reference(k3_dir) -> None:
    model = load_model(k3_dir, dtype=torch.float32, progress=False)
    ids = torch.randint(0, model.cfg.vocab_size, (11,), generator=seeded(11)).tolist()
    assert_rel(full_logits(model, ids), naive_k3_logits(k3_dir, ids), LOGITS_TOL, "K3 logits")


def test_k3_other_mla_geometry_matches_naive_reference(tmp_path) -> None:
    """The tiny K3 (q_lora, MLA output gate) with kv_lora_rank 48, rope 24, nope 40, v 24: widths from the config."""
    geometry = {"kv_lora_rank": 48, "qk_rope_head_dim": 24, "qk_nope_head_dim": 40, "v_head_dim": 24}
    root = write_tiny_checkpoint(tmp_path, seed=5, text_overrides=geometry)
    model = load_model(root, dtype=torch.float32, progress=False)
    assert model.cfg.mla_latent_width == 72
    ids = torch.randint(0, model.cfg.vocab_size, (11,), generator=seeded(12)).tolist()
    assert_rel(full_logits(model, ids), naive_k3_logits(root, ids), LOGITS_TOL, "K3 logits, other MLA geometry")


def test_kimi_linear_matches_transformers(tmp_path) -> None:
    hf = write_kimi_linear_checkpoint(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    ids = torch.randint(0, KL_VOCAB, (13,), generator=seeded(13))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_rel(full_logits(model, ids.tolist()), ref, LOGITS_TOL, "Kimi Linear logits")
