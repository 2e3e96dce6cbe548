"""The MLA layer (K3_SPEC section 3): DeepSeek-V3 latent attention with NoPE and an optional output gate.

One fused input GEMM gives ``q_in | c_kv | k_pe | gate`` where q_in is the query (no q_lora, Kimi Linear) or
its low-rank input (K3: ``q_a``, then RMSNorm and ``q_b``). The normalised latent ``[c_kv | k_pe]``
(R + P = kv_lora_rank + qk_rope_head_dim per token; 576 in K3) is written to the paged cache; prefill attends with
expanded keys/values (``mla_prefill``), decode in the absorbed R-d latent space (``mla_decode``) with ``W_uk``
folded into q and ``W_uv`` applied after. Every width comes from the config (K3 values in the shape comments:
R 512, P 64, Dn = qk_nope_head_dim 128, Dv = v_head_dim 128).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.model.config import MLA_NORM_EPS, ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView


@dataclasses.dataclass
class MLAWeights:
    """Load-time fused weights of one MLA layer (H heads).

    in_proj     [Q + R + P + G, hidden]  rows q_in | c_kv (R) | k_pe (P) | gate (G = H*Dv with the output gate)
    q_a_norm    [q_lora] or None;  q_b [H*(Dn+P), q_lora] or None (no q_lora: q_in is the query itself)
    kv_a_norm   [R];  kv_b [H*(Dn+Dv), R] (per head Dn rows W_uk then Dv rows W_uv);  o_proj [hidden, H*Dv]
    w_uk, w_uv  [H, Dn, R] / [H, Dv, R] views of kv_b for the absorbed decode
    """

    in_proj: torch.Tensor
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o_proj: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def from_checkpoint(cls, cfg: ModelConfig, t: Mapping[str, torch.Tensor]) -> MLAWeights:
        """``t`` maps names inside ``self_attn.`` (e.g. ``"kv_b_proj.weight"``) to loaded tensors."""
        q_in = t["q_proj.weight"] if cfg.q_lora_rank is None else t["q_a_proj.weight"]
        parts = [q_in, t["kv_a_proj_with_mqa.weight"]]
        if cfg.mla_use_output_gate:
            parts.append(t["g_proj.weight"])
        kv_b = t["kv_b_proj.weight"].contiguous()
        h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        per_head = kv_b.view(h, nope + v, cfg.kv_lora_rank)  # [H, Dn + Dv, R]
        return cls(
            in_proj=torch.cat(parts, dim=0).contiguous(),
            q_a_norm=None if cfg.q_lora_rank is None else t["q_a_layernorm.weight"],
            q_b=None if cfg.q_lora_rank is None else t["q_b_proj.weight"],
            kv_a_norm=t["kv_a_layernorm.weight"],
            kv_b=kv_b,
            o_proj=t["o_proj.weight"],
            w_uk=per_head[:, :nope],  # [H, Dn, R]
            w_uv=per_head[:, nope:],  # [H, Dv, R]
        )


class MLALayer:
    """``forward(x [T, hidden]) -> [T, hidden]``: the MLA sublayer of one decoder layer (before the residual)."""

    def __init__(self, cfg: ModelConfig, weights: MLAWeights, mla_index: int, backend: str | None) -> None:
        self.cfg = cfg
        self.w = weights
        self.mla_index = mla_index  # index among MLA layers: the cache's mla layer index
        self.backend = backend
        q_width = cfg.num_attention_heads * cfg.q_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        gate_width = cfg.num_attention_heads * cfg.v_head_dim if cfg.mla_use_output_gate else 0
        self.split = (q_width, cfg.kv_lora_rank, cfg.qk_rope_head_dim, gate_width)
        self.scale = cfg.q_head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        with record_function("mla"):
            return self._forward(x, batch, cache)

    def _forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        t, h = x.shape[0], cfg.num_attention_heads
        q_in, c_kv, k_pe, gate = F.linear(x, w.in_proj).split(self.split, dim=-1)
        if w.q_b is not None:
            q_in = F.linear(ops.rms_norm(q_in, w.q_a_norm, MLA_NORM_EPS, backend=self.backend), w.q_b)
        q = q_in.reshape(t, h, cfg.q_head_dim)  # [T, H, Dn + P] = nope | pe (never rotated: NoPE)
        c_kv = ops.rms_norm(c_kv, w.kv_a_norm, MLA_NORM_EPS, backend=self.backend)  # [T, R]
        kv_cache = cache.mla_kv(self.mla_index)  # [num_blocks, block_size, R + P]
        latent = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)  # [T, R + P]
        ops.mla_write_cache(latent, kv_cache, batch.slot_mapping, backend=self.backend)

        if batch.is_decode:
            q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
            q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w.w_uk)  # [N, H, R]: W_uk absorbed
            out_latent = ops.mla_decode(
                q_latent.to(kv_cache.dtype), q_pe.to(kv_cache.dtype).contiguous(), kv_cache, batch.block_table,
                batch.seq_lens, scale=self.scale, backend=self.backend,
            )  # [N, H, R]
            out = torch.einsum("nhc,hvc->nhv", out_latent.to(x.dtype), w.w_uv)  # [N, H, Dv]
        else:
            out = ops.mla_prefill(
                q.to(kv_cache.dtype).contiguous(), kv_cache, batch.block_table, batch.cu_seqlens, batch.seq_lens,
                w.kv_b.to(kv_cache.dtype), scale=self.scale, backend=self.backend,
            ).to(x.dtype)  # [T, H, Dv]
        out = out.reshape(t, h * cfg.v_head_dim)
        if cfg.mla_use_output_gate:
            out = out * torch.sigmoid(gate)
        return F.linear(out, w.o_proj)
