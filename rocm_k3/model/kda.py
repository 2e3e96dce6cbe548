"""The Kimi Delta Attention layer (K3_SPEC section 2) over the hybrid cache.

One fused input GEMM gives ``q | k | v | f_a | b | gate_in`` (gate_in: the full-rank output gate of K3, or the
rank-D ``g_a`` projection of Kimi Linear); the short conv, decay gate, chunked/recurrent delta rule and the gated
RMSNorm run through :mod:`rocm_k3.ops`. Recurrent state fp32 ``[S, H, K, V]`` and conv state ``[S, 3*H*D, W-1]``
live in the cache and are updated in place at the batch's KDA slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.ops.kda import KDAGateParams


@dataclasses.dataclass
class KDAWeights:
    """Load-time fused weights of one KDA layer (H heads of dim D, rank-D low-rank gates).

    in_proj   [3HD + D + H + G, hidden]  rows q | k | v | f_a | b | gate_in (G = HD full rank, else D)
    conv      [3HD, W]                   depthwise conv taps of q | k | v
    f_b       [HD, D]                    decay-gate up-projection
    g_b       [HD, D] or None            low-rank output-gate up-projection (Kimi Linear)
    A_log     fp32 [H];  dt_bias fp32 [HD];  o_norm [D];  o_proj [hidden, HD]
    """

    in_proj: torch.Tensor
    conv: torch.Tensor
    f_b: torch.Tensor
    g_b: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: torch.Tensor
    o_proj: torch.Tensor

    @classmethod
    def from_checkpoint(cls, cfg: ModelConfig, t: Mapping[str, torch.Tensor]) -> KDAWeights:
        """``t`` maps names inside ``self_attn.`` (e.g. ``"q_proj.weight"``) to loaded tensors."""
        gate_in = t["g_proj.weight"] if cfg.kda.full_rank_gate else t["g_a_proj.weight"]
        in_proj = torch.cat([t["q_proj.weight"], t["k_proj.weight"], t["v_proj.weight"], t["f_a_proj.weight"],
                             t["b_proj.weight"], gate_in], dim=0)
        conv = torch.cat([t[f"{x}_conv1d.weight"] for x in "qkv"], dim=0).squeeze(1)  # [3HD, 1, W] -> [3HD, W]
        return cls(
            in_proj=in_proj.contiguous(),
            conv=conv.contiguous(),
            f_b=t["f_b_proj.weight"],
            g_b=None if cfg.kda.full_rank_gate else t["g_b_proj.weight"],
            A_log=t["A_log"].reshape(-1)[:cfg.kda.num_heads].float(),  # [1, 1, H, 1], [H] or padded [D] -> [H]
            dt_bias=t["dt_bias"].reshape(-1).float(),
            o_norm=t["o_norm.weight"],
            o_proj=t["o_proj.weight"],
        )


class KDALayer:
    """``forward(x [T, hidden]) -> [T, hidden]``: the KDA sublayer of one decoder layer (before the residual)."""

    def __init__(self, cfg: ModelConfig, weights: KDAWeights, kda_index: int, backend: str | None) -> None:
        self.cfg = cfg
        self.w = weights
        self.kda_index = kda_index  # index among KDA layers: the cache's kda layer index
        self.backend = backend
        h, d = cfg.kda.num_heads, cfg.kda.head_dim
        gate_width = h * d if cfg.kda.full_rank_gate else d
        self.split = (3 * h * d, d, h, gate_width)  # qkv | f_a | b | gate_in

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        with record_function("kda"):
            return self._forward(x, batch, cache)

    def _forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        h, d = cfg.kda.num_heads, cfg.kda.head_dim
        qkv, f_low, b, gate_in = F.linear(x, w.in_proj).split(self.split, dim=-1)
        f = F.linear(f_low, w.f_b)  # [T, HD] raw decay-gate input
        gate = gate_in if w.g_b is None else F.linear(gate_in, w.g_b)  # [T, HD] output-gate logits
        state = cache.kda_state(self.kda_index)  # fp32 [S, H, D, D]
        conv_state = cache.conv_state(self.kda_index)  # [S, 3HD, W-1]
        if batch.is_decode:
            y = ops.kda_decode(
                qkv.contiguous(), f, b.contiguous(), gate.contiguous(), w.conv, conv_state, w.A_log, w.dt_bias,
                w.o_norm, state, batch.kda_slots, num_heads=h, lower_bound=cfg.kda.gate_lower_bound,
                eps=cfg.rms_norm_eps, backend=self.backend,
            )  # [N, HD]
            if batch.save_positions is not None:
                self._save_after_decode(batch, state, conv_state)
            return F.linear(y, w.o_proj)

        conv_saves = self._conv_snapshots(qkv, batch, conv_state) if batch.save_positions is not None else None
        mixed = ops.short_conv(
            qkv.contiguous(), w.conv, batch.cu_seqlens, conv_state=conv_state, state_indices=batch.kda_slots,
            has_initial_state=batch.has_initial_state, activation="silu", backend=self.backend,
        )  # [T, 3HD]
        t = x.shape[0]
        q, k, v = (part.reshape(t, h, d) for part in mixed.split(h * d, dim=-1))
        out = ops.kda_prefill(
            q, k, v, f.reshape(t, h, d), b.contiguous(), batch.cu_seqlens, state, batch.kda_slots,
            batch.has_initial_state, gate_params=KDAGateParams(w.A_log, w.dt_bias, cfg.kda.gate_lower_bound),
            qk_l2norm=True, beta_logits=True, intermediate_positions=batch.save_positions, backend=self.backend,
        )
        if batch.save_positions is not None:
            slots = batch.save_slots.long()
            state[slots] = out.intermediate_states
            conv_state[slots] = conv_saves
        y = ops.gated_rms_norm(out.o, gate.reshape(t, h, d), w.o_norm, cfg.rms_norm_eps, backend=self.backend)
        return F.linear(y.reshape(t, h * d), w.o_proj)

    @staticmethod
    def _conv_snapshots(qkv: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor) -> torch.Tensor:
        """Conv state after the first p new tokens of each save row: the last W-1 inputs before that point.

        Read before ``short_conv`` overwrites the sequences' slots. Returns [M, 3HD, W-1], oldest first.
        """
        hist = conv_state.shape[-1]  # W-1
        cu = batch.cu_seqlens.tolist()
        rows = []
        for (i, p) in batch.save_positions.tolist():
            start = cu[i]
            new = qkv[max(start, start + p - hist):start + p]  # [<= W-1, C]
            if new.shape[0] < hist:
                old = (conv_state[int(batch.kda_slots[i])].t() if bool(batch.has_initial_state[i])
                       else qkv.new_zeros(hist, qkv.shape[1]))  # [W-1, C]
                new = torch.cat([old, new], dim=0)[-hist:]
            rows.append(new.t())  # [C, W-1]
        return torch.stack(rows).to(conv_state.dtype)

    @staticmethod
    def _save_after_decode(batch: ForwardBatch, state: torch.Tensor, conv_state: torch.Tensor) -> None:
        """In a decode step every save row is (i, 1): the state after this step's only token."""
        rows = batch.save_positions.tolist()
        if any(p != 1 for _, p in rows):
            raise ValueError(f"save_positions: a decode step has one new token per sequence, got rows {rows}")
        src = batch.kda_slots[batch.save_positions[:, 0].long()].long()
        dst = batch.save_slots.long()
        state[dst] = state[src]
        conv_state[dst] = conv_state[src]
