"""The training forward: the K3 text model's prefill as a differentiable function of named tensors.

``forward_logits(cfg, params, input_ids [B, L]) -> logits fp32 [B, L, vocab]`` computes what
:meth:`rocm_k3.model.decoder.KimiModel.forward` computes for a fresh prompt (every position, no cache), with
``params`` mapping checkpoint names (``cfg.weight_prefix`` + canonical name, routed experts as dense
``experts.E.w{1,2,3}.weight``) to tensors, so autograd reaches every one of them. It calls the PyTorch reference
ops where they are differentiable as they stand (RMSNorm, the KDA gate, L2 norm and gated RMSNorm, SiTU, noaux_tc
routing, the AttnRes mix) and differentiable formulations of the same math where the serving path writes in
place or through a cache: the short conv (``F.conv1d``), the chunked delta rule
(:mod:`rocm_k3.training.delta_rule`), MLA prefill (expanded keys/values through
``F.scaled_dot_product_attention``), all routed experts run densely and weighted by the sparse routing weights,
and the AttnRes block bank kept as a list. Rows are independent sequences starting at position 0; right padding
only affects the padded positions (everything is causal).

This adapter stands in until the model's layers are ``torch.nn.Module``s; ``tests/training/test_training_forward.py``
checks it against ``KimiModel.forward`` on the embedded tiny model's weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from rocm_k3.model.checkpoint_names import layer_prefix
from rocm_k3.model.config import MLA_NORM_EPS, ModelConfig
from rocm_k3.ops.attn_res import REFERENCE_IMPLS as ATTN_RES_REFERENCE
from rocm_k3.ops.kda.reference import gated_rms_norm, kda_gate, l2norm
from rocm_k3.ops.moe_reference import route_reference, silu_and_mul_reference, situ_and_mul_reference
from rocm_k3.ops.norm import rms_norm_reference
from rocm_k3.training.delta_rule import TRAIN_CHUNK, chunked_delta_rule

Params = Mapping[str, torch.Tensor]
_attn_res_mix = ATTN_RES_REFERENCE["attn_res_mix"]


def forward_logits(cfg: ModelConfig, params: Params, input_ids: torch.Tensor, *, kda_chunk: int = TRAIN_CHUNK,
                   expert_counts: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits fp32 [B, L, vocab] at every position of ``input_ids`` int64 [B, L].

    expert_counts: if given, filled with MoE layer -> int64 [E] tokens routed to each expert (all positions).
    """
    hidden = forward_hidden(cfg, params, input_ids, kda_chunk=kda_chunk, expert_counts=expert_counts)
    head = params[cfg.weight_prefix + ("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")]
    return F.linear(hidden, head).float()


def forward_hidden(cfg: ModelConfig, params: Params, input_ids: torch.Tensor, *, kda_chunk: int = TRAIN_CHUNK,
                   expert_counts: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Final-normed hidden states [B, L, hidden] (``expert_counts``: see :func:`forward_logits`)."""
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids: expected int64 [B, L], got {input_ids.dtype} {list(input_ids.shape)}")
    p = _Named(params, cfg.weight_prefix)
    b, length = input_ids.shape
    h0 = F.embedding(input_ids, p["model.embed_tokens.weight"]).reshape(b * length, -1)  # [T, hidden]
    layers = []
    for index in range(cfg.num_hidden_layers):
        lp = p.sub(layer_prefix(index))
        if cfg.is_mla_layer(index):
            attn = _mla(cfg, lp.sub("self_attn."), b, length)
        else:
            attn = _kda(cfg, lp.sub("self_attn."), b, length, kda_chunk)
        if cfg.is_moe_layer(index):
            ffn = _moe(cfg, lp.sub("block_sparse_moe."), index, expert_counts)
        else:
            ffn = _mlp(cfg, lp.sub("mlp."))
        layers.append((lp, attn, ffn))
    eps = cfg.rms_norm_eps
    if cfg.uses_attn_res:
        out = _attn_res_stack(cfg, p, h0, layers)
    else:
        out = _residual_stack(p, h0, layers, eps)
    return out.reshape(b, length, -1)


class _Named:
    """Read access to ``params`` under a name prefix."""

    def __init__(self, params: Params, prefix: str) -> None:
        self.params = params
        self.prefix = prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.params[self.prefix + name]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.params

    def sub(self, prefix: str) -> _Named:
        return _Named(self.params, self.prefix + prefix)


Sublayer = Callable[[torch.Tensor], torch.Tensor]  # [T, hidden] -> [T, hidden]


# ---------------------------------------------------------------------------------------------------- stacks
def _residual_stack(p: _Named, h0: torch.Tensor, layers: list[tuple[_Named, Sublayer, Sublayer]],
                    eps: float) -> torch.Tensor:
    """Plain pre-norm residual (Kimi Linear)."""
    h = h0
    for lp, attn, ffn in layers:
        h = h + attn(rms_norm_reference(h, lp["input_layernorm.weight"], eps))
        h = h + ffn(rms_norm_reference(h, lp["post_attention_layernorm.weight"], eps))
    return rms_norm_reference(h, p["model.norm.weight"], eps)


def _mix(partial: torch.Tensor, blocks: list[torch.Tensor], count: int, proj: torch.Tensor, norm: torch.Tensor,
         rms: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the AttnRes mix over ``blocks[:count]`` and ``partial`` [T, hidden]."""
    bank = torch.stack(blocks[:count]) if count else partial.new_zeros(0, *partial.shape)  # [count, T, hidden]
    mixed = _attn_res_mix(partial, bank, count, proj.reshape(-1), norm, eps)
    return rms_norm_reference(mixed, rms, eps)


def _attn_res_stack(cfg: ModelConfig, p: _Named, h0: torch.Tensor,
                    layers: list[tuple[_Named, Sublayer, Sublayer]]) -> torch.Tensor:
    """The Attention Residuals dataflow of :mod:`rocm_k3.model.attn_res`, with the block bank as a list."""
    size, eps = cfg.attn_res_block_size, cfg.rms_norm_eps
    blocks: list[torch.Tensor] = []  # b_0 = the embedding, then one snapshot per finished block
    partial: torch.Tensor | None = h0
    delta: torch.Tensor | None = None
    for index, (lp, attn, ffn) in enumerate(layers):
        count = math.ceil(index / size)
        write = index % size == 0
        cur = _accumulate(partial, delta)
        x = _mix(cur, blocks, count, lp["self_attention_res_proj.weight"], lp["self_attention_res_norm.weight"],
                 lp["input_layernorm.weight"], eps)
        if write:
            blocks.append(cur)
        a = attn(x)
        cur = a if write else cur + a
        x = _mix(cur, blocks, count + int(write), lp["mlp_res_proj.weight"], lp["mlp_res_norm.weight"],
                 lp["post_attention_layernorm.weight"], eps)
        partial, delta = cur, ffn(x)
    cur = _accumulate(partial, delta)
    return _mix(cur, blocks, len(blocks), p["model.output_attn_res_proj.weight"],
                p["model.output_attn_res_norm.weight"], p["model.norm.weight"], eps)


def _accumulate(partial: torch.Tensor | None, delta: torch.Tensor | None) -> torch.Tensor:
    if partial is None:
        return delta
    return partial if delta is None else partial + delta


# ---------------------------------------------------------------------------------------------------- mixers
def _kda(cfg: ModelConfig, w: _Named, b: int, length: int, chunk: int) -> Sublayer:
    kc = cfg.kda
    h, d = kc.num_heads, kc.head_dim

    def run(x: torch.Tensor) -> torch.Tensor:  # x [T, hidden], T = B * L
        qkv = torch.cat([F.linear(x, w[f"{n}_proj.weight"]) for n in "qkv"], dim=-1)  # [T, 3HD]
        conv = torch.cat([w[f"{n}_conv1d.weight"] for n in "qkv"], dim=0)  # [3HD, 1, W]
        mixed = F.silu(_causal_conv(qkv.reshape(b, length, 3 * h * d), conv.squeeze(1)))  # [B, L, 3HD]
        q, k, v = mixed.reshape(b * length, 3, h, d).unbind(dim=1)  # each [T, H, D]
        f = F.linear(F.linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]).reshape(-1, h, d)  # [T, H, D]
        g = kda_gate(f, w["A_log"].reshape(-1)[:h], w["dt_bias"].reshape(-1), kc.gate_lower_bound)  # fp32
        beta = torch.sigmoid(F.linear(x, w["b_proj.weight"]).float())  # [T, H]
        if kc.full_rank_gate:
            gate = F.linear(x, w["g_proj.weight"])
        else:
            gate = F.linear(F.linear(x, w["g_a_proj.weight"]), w["g_b_proj.weight"])  # [T, HD]
        q = l2norm(q.float()) * d ** -0.5
        k = l2norm(k.float())

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, length, *t.shape[1:])

        o = chunked_delta_rule(rows(q), rows(k), rows(v.float()), rows(g), rows(beta), chunk)  # [B, L, H, D]
        y = gated_rms_norm(o.reshape(-1, h, d).to(x.dtype), gate.reshape(-1, h, d), w["o_norm.weight"],
                           cfg.rms_norm_eps)
        return F.linear(y.reshape(-1, h * d), w["o_proj.weight"])

    return run


def _causal_conv(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv with zero history: ``y[t, c] = sum_j taps[c, j] * x[t - (W-1) + j, c]``.

    x [B, L, C], taps [C, W]; shifted multiply-adds (the CPU's depthwise conv1d backward is far slower)."""
    width, length = taps.shape[1], x.shape[1]
    padded = F.pad(x, (0, 0, width - 1, 0))  # [B, W-1+L, C]
    return sum(padded[:, j:j + length] * taps[:, j] for j in range(width))


def _mla(cfg: ModelConfig, w: _Named, b: int, length: int) -> Sublayer:
    h, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def run(x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        if cfg.q_lora_rank is None:
            q = F.linear(x, w["q_proj.weight"])
        else:
            q = F.linear(rms_norm_reference(F.linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"],
                                            MLA_NORM_EPS), w["q_b_proj.weight"])
        q = q.reshape(b, length, h, nope + rope).transpose(1, 2)  # [B, H, L, 192]; NoPE: never rotated
        c_kv, k_pe = F.linear(x, w["kv_a_proj_with_mqa.weight"]).split([cfg.kv_lora_rank, rope], dim=-1)
        c_kv = rms_norm_reference(c_kv, w["kv_a_layernorm.weight"], MLA_NORM_EPS)  # [T, 512]
        kv_b = w["kv_b_proj.weight"].reshape(h, nope + vd, cfg.kv_lora_rank)  # [H, 256, 512]
        kv = torch.einsum("tc,hdc->htd", c_kv, kv_b).reshape(h, b, length, nope + vd).transpose(0, 1)
        k_nope, v = kv.split([nope, vd], dim=-1)  # [B, H, L, 128] each
        k = torch.cat([k_nope, k_pe.reshape(b, 1, length, rope).expand(b, h, length, rope)], dim=-1)
        # values zero-padded to the query width: the CPU's fused causal kernel wants equal head dims (~3x faster)
        v = F.pad(v, (0, max(0, nope + rope - vd)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(nope + rope) ** -0.5)[..., :vd]
        out = out.transpose(1, 2).reshape(b * length, h * vd)  # [T, H*128]
        if cfg.mla_use_output_gate:
            out = out * torch.sigmoid(F.linear(x, w["g_proj.weight"]))
        return F.linear(out, w["o_proj.weight"])

    return run


# ---------------------------------------------------------------------------------------------------- FFNs
def _act_and_mul(cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    if cfg.hidden_act == "situ":
        return situ_and_mul_reference(h, cfg.situ_beta, cfg.situ_linear_beta)
    return silu_and_mul_reference(h)


def _dense(cfg: ModelConfig, w: _Named, x: torch.Tensor) -> torch.Tensor:
    gate_up = torch.cat([w["gate_proj.weight"], w["up_proj.weight"]], dim=0)  # [2I, hidden]
    return F.linear(_act_and_mul(cfg, F.linear(x, gate_up)), w["down_proj.weight"])


def _mlp(cfg: ModelConfig, w: _Named) -> Sublayer:
    return lambda x: _dense(cfg, w, x)


def _moe(cfg: ModelConfig, w: _Named, layer: int, counts: dict[int, torch.Tensor] | None) -> Sublayer:
    e = cfg.num_experts

    def run(x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        logits = F.linear(x.float(), w["gate.weight"].float())  # fp32 [T, E]
        routed = route_reference(logits, cfg.num_experts_per_token, correction_bias=w["gate.e_score_correction_bias"],
                                 renormalize=cfg.moe_renormalize, scaling_factor=cfg.routed_scaling_factor)
        if counts is not None:
            counts[layer] = torch.bincount(routed.ids.reshape(-1).long(), minlength=e)
        dense_weights = torch.zeros_like(logits).scatter(1, routed.ids.long(), routed.weights)  # [T, E], 0 = unused
        latent = cfg.routed_expert_hidden_size is not None
        z = F.linear(x, w["routed_expert_down_proj.weight"]) if latent else x  # [T, expert width]
        w13 = torch.stack([torch.cat([w[f"experts.{i}.w1.weight"], w[f"experts.{i}.w3.weight"]]) for i in range(e)])
        w2 = torch.stack([w[f"experts.{i}.w2.weight"] for i in range(e)])  # [E, width, I]
        act = _act_and_mul(cfg, torch.einsum("tk,enk->etn", z.float(), w13.float()))  # [E, T, I]
        y = torch.einsum("etn,ekn->etk", act, w2.float())  # [E, T, width]
        r = torch.einsum("te,etk->tk", dense_weights, y).to(x.dtype)  # [T, width]
        if latent:
            if cfg.latent_moe_use_norm:
                r = rms_norm_reference(r, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
            r = F.linear(r, w["routed_expert_up_proj.weight"])
        if cfg.num_shared_experts:
            r = r + _dense(cfg, w.sub("shared_experts."), x)
        return r

    return run
