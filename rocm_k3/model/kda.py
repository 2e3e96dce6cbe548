"""The Kimi Delta Attention layer (K3_SPEC section 2) over the hybrid cache, split by head under tensor parallelism.

One merged input GEMM gives ``q | k | v | f_a | b | gate_in`` (gate_in: the full-rank output gate of K3, or the
rank-D ``g_a`` projection of Kimi Linear). Under TP each rank owns ``H / tp`` heads: the q/k/v/b/gate rows, conv
channels, ``A_log``, ``dt_bias`` and ``f_b`` / ``g_b`` rows of its heads; ``f_a`` (and Kimi Linear's ``g_a``) is
replicated; ``o_proj`` is row-parallel and all-reduces (the layer's one collective). The short conv, decay
gate, chunked/recurrent delta rule and the gated RMSNorm run through the ops with the local head count; the
recurrent state fp32 ``[S, H/tp, K, V]`` and conv state ``[S, 3*(H/tp)*D, W-1]`` live in the cache.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, Shard
from rocm_k3.model.layers.weights import Read, Target, WeightTargets, column, new_param
from rocm_k3.ops.kda import KDAGateParams


class KDALayer(WeightTargets):
    """``forward(x [T, hidden], batch, cache) -> [T, hidden]``: the KDA sublayer of one decoder layer.

    prefix: the checkpoint prefix of the layer's ``self_attn.`` tensors; cache_index: the layer's index among
    this stage's KDA layers (its slot pools in the cache).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, table, prefix: str, cache_index: int, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg, self.ctx, self.table = cfg, ctx, table
        self.cache_index = cache_index
        h, d, w, hid = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size, cfg.hidden_size
        self.prefix = prefix
        _, self.heads = ctx.shard(h, f"{prefix} KDA heads")
        hl = self.heads
        full = cfg.kda.full_rank_gate
        gate = Shard(prefix + "g_proj.weight", h * d) if full else Shard(prefix + "g_a_proj.weight", d, split=False)
        self.in_proj = MergedColumnParallelLinear(hid, [
            Shard(prefix + "q_proj.weight", h * d), Shard(prefix + "k_proj.weight", h * d),
            Shard(prefix + "v_proj.weight", h * d), Shard(prefix + "f_a_proj.weight", d, split=False),
            Shard(prefix + "b_proj.weight", h), gate,
        ], ctx, dtype=dtype, device=device)  # [3 HlD + D + Hl + G, hidden]
        self.split = (3 * hl * d, d, hl, hl * d if full else d)  # qkv | f_a | b | gate_in (local widths)
        self.f_b = ColumnParallelLinear(d, h * d, prefix + "f_b_proj.weight", ctx, dtype=dtype, device=device)
        self.g_b = None if full else ColumnParallelLinear(d, h * d, prefix + "g_b_proj.weight", ctx, dtype=dtype,
                                                          device=device)
        self.conv = new_param((3 * hl * d, w), dtype, device)  # [3 Hl D, W] depthwise taps of q | k | v
        self.A_log = new_param((hl,), torch.float32, device)  # [Hl]
        self.dt_bias = new_param((hl * d,), torch.float32, device)  # [Hl D]
        self.o_norm = new_param((d,), dtype, device)  # [D]
        self.o_proj = RowParallelLinear(h * d, hid, prefix + "o_proj.weight", ctx, table, dtype=dtype, device=device)

    def own_targets(self) -> dict[str, Target]:
        p, d, hl, r = self.prefix, self.cfg.kda.head_dim, self.heads, self.ctx.tp_rank
        h = self.cfg.kda.num_heads
        out = {p + f"{x}_conv1d.weight": Target(self.conv[i * hl * d : (i + 1) * hl * d],
                                                column(r, hl * d, _squeeze_conv))
               for i, x in enumerate("qkv")}  # [H D, 1, W] -> this rank's rows [Hl D, W]

        def a_log(t: torch.Tensor) -> torch.Tensor:  # [1, 1, H, 1], [H] or K3's zero-padded [D] -> [Hl]
            return t.reshape(-1)[:h][r * hl : (r + 1) * hl]

        out[p + "A_log"] = Target(self.A_log, Read(transform=a_log))
        out[p + "dt_bias"] = Target(self.dt_bias, column(r, hl * d))
        out[p + "o_norm.weight"] = Target(self.o_norm)
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        with record_function("kda"):
            return self._forward(x, batch, cache)

    def _forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        cfg, table = self.cfg, self.table
        h, d = self.heads, cfg.kda.head_dim
        qkv, f_low, b, gate_in = self.in_proj(x).split(self.split, dim=-1)
        f = self.f_b(f_low)  # [T, Hl D] raw decay-gate input
        gate = gate_in if self.g_b is None else self.g_b(gate_in)  # [T, Hl D] output-gate logits
        state = cache.kda_state(self.cache_index)  # fp32 [S, Hl, D, D]
        conv_state = cache.conv_state(self.cache_index)  # [S, 3 Hl D, W-1]
        if batch.is_decode and batch.decode_width > 1:
            return self.o_proj(self._verify_decode(qkv, f, b, gate, batch, state, conv_state))
        if batch.is_decode:
            y = self._decode(qkv, f, b, gate, batch.kda_slots, state, conv_state)  # [N, Hl D]
            if batch.save_positions is not None:
                self._save_after_decode(batch, state, conv_state)
            return self.o_proj(y)

        conv_saves = self._conv_snapshots(qkv, batch, conv_state) if batch.save_positions is not None else None
        mixed = ops.short_conv(
            qkv, self.conv, batch.cu_seqlens, conv_state=conv_state, state_indices=batch.kda_slots,
            has_initial_state=batch.has_initial_state, activation="silu", backend=table,
        )  # [T, 3 Hl D]
        t = x.shape[0]
        q, k, v = (part.reshape(t, h, d) for part in mixed.split(h * d, dim=-1))
        out = ops.kda_prefill(
            q, k, v, f.reshape(t, h, d), b.contiguous(), batch.cu_seqlens, state, batch.kda_slots,
            batch.has_initial_state, gate_params=KDAGateParams(self.A_log, self.dt_bias, cfg.kda.gate_lower_bound),
            qk_l2norm=True, beta_logits=True, intermediate_positions=batch.save_positions, backend=table,
        )
        if batch.save_positions is not None:
            slots = batch.save_slots.long()
            state[slots] = out.intermediate_states
            conv_state[slots] = conv_saves
        y = ops.gated_rms_norm(out.o, gate.reshape(t, h, d), self.o_norm, cfg.rms_norm_eps, backend=table)
        return self.o_proj(y.reshape(t, h * d))

    def _decode(self, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, slots: torch.Tensor,
                state: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """One token per row through the recurrent decode op (states at ``slots`` advance in place); [N, Hl D]."""
        cfg = self.cfg
        return ops.kda_decode(
            qkv.contiguous(), f.contiguous(), b.contiguous(), gate.contiguous(), self.conv, conv_state, self.A_log,
            self.dt_bias, self.o_norm, state, slots.contiguous(), num_heads=self.heads,
            lower_bound=cfg.kda.gate_lower_bound, eps=cfg.rms_norm_eps, backend=self.table,
        )

    def _verify_decode(self, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor,
                       batch: ForwardBatch, state: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """A speculative verification in decode shape (``batch.decode_width`` w > 1): token column j of every group
        goes through the decode op in turn, and after column j < w - 1 the states of its rows are copied to the save
        slots of that column (no host read: a CUDA graph captures it). Returns [T, Hl D] in row order."""
        w = batch.decode_width
        g = qkv.shape[0] // w

        def col(t: torch.Tensor, j: int) -> torch.Tensor:
            return t.view(g, w, -1)[:, j]

        slots = batch.kda_slots.view(g, w)
        saves = None if batch.save_slots is None else batch.save_slots.view(g, w - 1)
        out = []
        for j in range(w):
            out.append(self._decode(col(qkv, j), col(f, j), col(b, j), col(gate, j), slots[:, j], state, conv_state))
            if saves is not None and j < w - 1:
                src, dst = slots[:, j].long(), saves[:, j].long()
                state[dst] = state[src]
                conv_state[dst] = conv_state[src]
        return torch.stack(out, dim=1).reshape(qkv.shape[0], -1)  # [G, w, Hl D] -> [T, Hl D]

    @staticmethod
    def _conv_snapshots(qkv: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor) -> torch.Tensor:
        """Conv state after the first p new tokens of each save row (i, p): the last W-1 inputs before that point,
        taken from this step's rows and, where p < W-1, from the sequence's old history (zeros without one).

        Read before ``short_conv`` overwrites the sequences' slots. Gathers on the device (no host read, a fixed
        number of launches whatever the number of rows). Returns [M, 3HD, W-1], oldest first.
        """
        hist = conv_state.shape[-1]  # W-1
        pos = batch.save_positions.long()  # [M, 2]
        seq, p = pos[:, 0], pos[:, 1]  # [M]
        j = torch.arange(hist, device=qkv.device)  # [W-1]
        back = p[:, None] - hist + j[None, :]  # [M, W-1] offset from the sequence's first new row (< 0: history)
        rows = batch.cu_seqlens.long()[seq][:, None] + back  # [M, W-1] rows of qkv
        new = qkv[rows.clamp(0, max(qkv.shape[0] - 1, 0))]  # [M, W-1, C]
        slots = batch.kda_slots.long()[seq]  # [M]
        at = (back + hist).clamp(0, hist - 1)  # [M, W-1] history entry of a position before the new rows
        old = conv_state[slots].gather(2, at[:, None, :].expand(-1, conv_state.shape[1], -1))  # [M, C, W-1]
        old = torch.where(batch.has_initial_state[seq].bool()[:, None, None], old, 0.0)  # a fresh slot: zeros
        return torch.where((back >= 0)[:, None, :], new.transpose(1, 2).to(conv_state.dtype), old)

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


def _squeeze_conv(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1)  # [rows, 1, W] -> [rows, W]
