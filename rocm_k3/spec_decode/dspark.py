"""The K3 DSpark drafter (layout in :mod:`rocm_k3.spec_decode.dspark_config`): a block of drafts in one pass.

Context: for every token position t the target has run, the target's residual streams after the layers
``target_layer_ids`` are concatenated and fused, ``c_t = context_norm(context_proj(concat))`` [H], and each draft
layer keeps ``c_t``'s latent key ``[kv_a_layernorm(c_kv) | RoPE_t(k_pe)]`` from its ``kv_a_proj_with_mqa`` (keys
only: context positions are never queried). Drafting after the target sampled token x at position p (the anchor):
the block ``[x, mask, ..., mask]`` (1 + k tokens, embedded by the target's embedding, positions p .. p + k) runs the
pre-norm decoder layers, each attending to the request's whole context plus the whole block (non-causal inside
the block); ``final_norm`` then the target's LM head give base logits at block rows 1 .. k, and the Markov head
adds, left to right, ``markov_w2 @ markov_w1[previous token]`` (the previous token: the anchor, then each draft)
before the greedy pick. Greedy drafts are deterministic, so the worker's acceptance rule stays exact.

MLA: DeepSeek-V3 shape with q-LoRA, keys and values from the latent (``kv_b_proj``: per head ``[k_nope Dn | v Dv]``,
applied absorbed: to q and to the output, so a step costs O(block x context x R), never expanding the context),
``q_b_proj`` per head ``[q_nope Dn | q_pe P]``; interleaved-pair (GPT-J style) RoPE on
the P dims with DeepSeek YaRN frequencies; softmax scale ``(Dn + P) ** -0.5 * yarn_mscale(factor,
mscale_all_dim) ** 2``. MLP: ``down(silu(gate(x)) * up(x))``. RMSNorms in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rocm_k3.ops.norm import rms_norm
from rocm_k3.spec_decode.dspark_config import DSparkConfig, YarnRope


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(rope: YarnRope, dim: int) -> torch.Tensor:
    """Inverse frequencies fp32 [dim / 2]: plain RoPE, or DeepSeek YaRN's blend of interpolated and extrapolated
    frequencies over a linear ramp between the beta_fast / beta_slow correction dims."""
    base = 1.0 / rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim / 2]
    if rope.factor <= 1:
        return base.float()

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low if high > low else 0.001)
    extrapolate = 1 - ramp.clamp(0, 1)  # 1: keep the original frequency, 0: interpolate by factor
    return (base / rope.factor * (1 - extrapolate) + base * extrapolate).float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """Interleaved-pair RoPE: ``x`` [S, ..., P] at ``positions`` int64 [S]; pairs (2i, 2i + 1) turn by
    position * inv_freq[i]; cos / sin scaled by ``scale`` (YaRN's mscale ratio)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]  # [S, P / 2]
    shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
    cos, sin = (angles.cos() * scale).view(shape), (angles.sin() * scale).view(shape)
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # the op interface: the backend in use, not always the reference


class DSparkAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, n = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, h, bias=False)

    def latent(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               rope_scale: float) -> torch.Tensor:
        """The cached latent [S, R + P] of ``x`` [S, H]: normed c_kv, then k_pe turned to ``positions``."""
        r = self.cfg.kv_lora_rank
        kv = self.kv_a_proj_with_mqa(x)  # [S, R + P]
        return torch.cat([self.kv_a_layernorm(kv[:, :r]), apply_rope(kv[:, r:], positions, inv_freq, rope_scale)],
                         dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor, inv_freq: torch.Tensor,
                rope_scale: float, softmax_scale: float) -> torch.Tensor:
        """``x`` [S, H] (the block, at ``positions`` [S]) attending to ``context`` [C, R + P] and the whole block."""
        cfg = self.cfg
        n, dn, p, r, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                           cfg.v_head_dim)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(-1, n, dn + p)  # [S, n, Dn + P]
        q_pe = apply_rope(q[..., dn:], positions, inv_freq, rope_scale)  # [S, n, P]
        keys = torch.cat([context.to(x.dtype), self.latent(x, positions, inv_freq, rope_scale)]).float()  # [C+S, R+P]
        # absorbed: the key / value up-projections act on q and on the output, never on the C context rows
        w = self.kv_b_proj.weight.float().view(n, dn + dv, r)  # [n, Dn + Dv, R]
        q_lat = torch.einsum("snd,ndr->snr", q[..., :dn].float(), w[:, :dn])  # [S, n, R]
        scores = (torch.einsum("snr,cr->nsc", q_lat, keys[:, :r])
                  + torch.einsum("snp,cp->nsc", q_pe.float(), keys[:, r:])) * softmax_scale  # [n, S, C + S]
        o_lat = torch.einsum("nsc,cr->snr", scores.softmax(dim=-1), keys[:, :r])  # [S, n, R]
        out = torch.einsum("snr,ndr->snd", o_lat, w[:, dn:])  # [S, n, Dv]
        return self.o_proj(out.reshape(x.shape[0], n * dv).to(x.dtype))


class DSparkMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DSparkMLP(cfg)


class MarkovHead(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)  # [V, r]
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)  # [V, r]

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        """The transition bias fp32 [B, V] after tokens ``previous`` int64 [B]."""
        return F.linear(self.markov_w1(previous).float(), self.markov_w2.weight.float())


class DSparkDrafter(nn.Module):
    """Parameter names are the checkpoint's (``state_dict()`` keys = :func:`dspark_config.tensor_shapes`)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.context_proj = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size,
                                      bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg)
        rope = cfg.rope
        self.register_buffer("inv_freq", rope_inv_freq(rope, cfg.qk_rope_head_dim), persistent=False)
        self.rope_scale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        self.softmax_scale = cfg.q_head_dim ** -0.5 * yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2

    @torch.inference_mode()
    def context(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every layer's latent keys [L, T, R + P] of the target's tapped streams ``taps`` [T, k, Ht] at
        ``positions`` int64 [T]."""
        dtype = self.context_proj.weight.dtype
        c = self.context_norm(self.context_proj(taps.flatten(1).to(dtype)))  # [T, H]
        return torch.stack([layer.self_attn.latent(c, positions, self.inv_freq, self.rope_scale)
                            for layer in self.layers])

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, anchor: int, position: int, k: int, embed, lm_head) -> list[int]:
        """k greedy drafts after token ``anchor`` at ``position``, attending to ``context`` [L, C, R + P];
        ``embed`` (ids [S] -> [S, H]) and ``lm_head`` (hidden [S, H] -> fp32 logits [S, V]) are the target's."""
        dev = context.device
        ids = torch.full((1 + k,), self.cfg.mask_token_id, dtype=torch.int64, device=dev)
        ids[0] = anchor
        positions = torch.arange(position, position + 1 + k, device=dev)
        x = embed(ids).to(self.context_proj.weight.dtype)  # [1 + k, H]
        for layer, ctx in zip(self.layers, context):
            x = x + layer.self_attn(layer.input_layernorm(x), positions, ctx, self.inv_freq, self.rope_scale,
                                    self.softmax_scale)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = lm_head(self.final_norm(x)[1:]).float()  # [k, V]
        drafts, previous = [], ids[:1]
        for j in range(k):
            previous = (logits[j : j + 1] + self.markov_head.bias(previous)).argmax(dim=-1)  # [1]
            drafts.append(previous)
        return torch.cat(drafts).tolist()
