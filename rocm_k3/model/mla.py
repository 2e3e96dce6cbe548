"""The MLA layer (K3_SPEC section 3): DeepSeek-V3 latent attention with NoPE and an optional output gate.

One merged input GEMM gives ``q_in | c_kv | k_pe | gate`` where q_in is the query (no q_lora, Kimi Linear) or
its low-rank input (K3: ``q_a``, then RMSNorm and ``q_b``). The normalised latent ``[c_kv | k_pe]``
(R + P = kv_lora_rank + qk_rope_head_dim per token; 576 in K3) is written to the paged cache; prefill attends with
expanded keys/values (``mla_prefill``, which also applies the output gate: fused into the kernel's epilogue),
decode in the absorbed R-d latent space (``mla_decode``) with ``W_uk`` folded into q and ``W_uv`` applied after
(and the gate in :meth:`MLALayer.output`). Every width comes from the config (K3 values in the shape comments:
R 512, P 64, Dn = qk_nope_head_dim 128, Dv = v_head_dim 128).

Tensor parallelism: q_a / kv_a and their norms are replicated (every rank caches the full latent); q_b (or the
whole q_proj without q_lora), kv_b and the output gate are split by head; o_proj is row-parallel and
all-reduces (the layer's one collective).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.config import MLA_NORM_EPS, ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, Shard
from rocm_k3.model.layers.weights import Target, WeightTargets, new_param


class MLALayer(WeightTargets):
    """``forward(x [T, hidden], batch, cache) -> [T, hidden]``: the MLA sublayer of one decoder layer.

    cache_index: the layer's index among this stage's MLA layers (its page pool in the cache).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, table, prefix: str, cache_index: int, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg, self.ctx, self.table, self.prefix = cfg, ctx, table, prefix
        self.cache_index = cache_index
        h, hid = cfg.num_attention_heads, cfg.hidden_size
        _, self.heads = ctx.shard(h, f"{prefix} MLA heads")
        hl, nope, v = self.heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        shards = [Shard(prefix + "q_proj.weight", h * cfg.q_head_dim) if cfg.q_lora_rank is None
                  else Shard(prefix + "q_a_proj.weight", cfg.q_lora_rank, split=False),
                  Shard(prefix + "kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, split=False)]
        if cfg.mla_use_output_gate:
            shards.append(Shard(prefix + "g_proj.weight", h * v))
        self.in_proj = MergedColumnParallelLinear(hid, shards, ctx, dtype=dtype, device=device)
        q_width = hl * cfg.q_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        self.split = (q_width, cfg.kv_lora_rank, cfg.qk_rope_head_dim, hl * v if cfg.mla_use_output_gate else 0)
        self.q_a_norm = self.q_b = None
        if cfg.q_lora_rank is not None:
            self.q_a_norm = new_param((cfg.q_lora_rank,), dtype, device)
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, h * cfg.q_head_dim, prefix + "q_b_proj.weight", ctx,
                                            dtype=dtype, device=device)
        self.kv_a_norm = new_param((cfg.kv_lora_rank,), dtype, device)
        self.kv_b = ColumnParallelLinear(cfg.kv_lora_rank, h * (nope + v), prefix + "kv_b_proj.weight", ctx,
                                         dtype=dtype, device=device)  # [Hl (Dn + Dv), R]
        self.o_proj = RowParallelLinear(h * v, hid, prefix + "o_proj.weight", ctx, table, dtype=dtype, device=device)
        self.scale = cfg.q_head_dim ** -0.5

    def own_targets(self) -> dict[str, Target]:
        out = {self.prefix + "kv_a_layernorm.weight": Target(self.kv_a_norm)}
        if self.q_a_norm is not None:
            out[self.prefix + "q_a_layernorm.weight"] = Target(self.q_a_norm)
        return out

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b for the absorbed decode: W_uk [Hl, Dn, R] and W_uv [Hl, Dv, R]."""
        cfg = self.cfg
        per_head = self.kv_b.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        with record_function("mla"):
            return self._forward(x, batch, cache)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention inputs of ``x [T, hidden]``: q [T, Hl, Dn + P] (nope | pe, never rotated: NoPE), the
        normalised latent c_kv [T, R], k_pe [T, P] and the output-gate logits [T, Hl Dv] (empty without a gate)."""
        table = self.table
        q_in, c_kv, k_pe, gate = self.in_proj(x).split(self.split, dim=-1)
        if self.q_b is not None:
            q_in = self.q_b(ops.rms_norm(q_in, self.q_a_norm, MLA_NORM_EPS, backend=table))
        q = q_in.reshape(x.shape[0], self.heads, self.cfg.q_head_dim)  # [T, Hl, Dn + P]
        return q, ops.rms_norm(c_kv, self.kv_a_norm, MLA_NORM_EPS, backend=table), k_pe, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o_proj`` of the attention output ``out [T, Hl, Dv]``, gated by ``sigmoid(gate)`` when the model has an
        output gate and ``gate`` is given (None: already applied by the attention op); [T, hidden]."""
        out = out.reshape(out.shape[0], self.heads * self.cfg.v_head_dim)
        if self.cfg.mla_use_output_gate and gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        cfg, table = self.cfg, self.table
        q, c_kv, k_pe, gate = self.project(x)
        kv_cache = cache.mla_kv(self.cache_index)  # [num_blocks, block_size, R + P]
        latent = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)  # [T, R + P]
        ops.mla_write_cache(latent, kv_cache, batch.slot_mapping, backend=table)

        if batch.is_decode:
            w_uk, w_uv = self._w_uk_uv()
            q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
            q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)  # [N, Hl, R]: W_uk absorbed
            out_latent = ops.mla_decode(
                q_latent.to(kv_cache.dtype), q_pe.to(kv_cache.dtype).contiguous(), kv_cache, batch.block_table,
                batch.seq_lens, scale=self.scale, backend=table,
            )  # [N, Hl, R]
            out = torch.einsum("nhc,hvc->nhv", out_latent.to(x.dtype), w_uv)  # [N, Hl, Dv]
        else:
            # the output gate goes into the prefill kernel's epilogue (fp32, one rounding; gate [T, Hl, Dv])
            fused = {"gate": gate.view(x.shape[0], self.heads, cfg.v_head_dim)} if cfg.mla_use_output_gate else {}
            out = ops.mla_prefill(
                q.to(kv_cache.dtype).contiguous(), kv_cache, batch.block_table, batch.cu_seqlens, batch.seq_lens,
                self.kv_b.weight.to(kv_cache.dtype), scale=self.scale, backend=table, **fused,
            ).to(x.dtype)  # [T, Hl, Dv]
            gate = None if fused else gate
        return self.output(out, gate)
