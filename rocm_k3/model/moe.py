"""Feed-forward blocks (K3_SPEC section 4): the dense MLP of the first layers and the MoE block, shardable.

MoE: ``s = sigmoid(x W_gate^T)`` (fp32), top-k of ``s + bias`` (noaux_tc), weights renormalised and scaled;
routed experts run on ``x`` or, with LatentMoE, on ``z = down_proj(x)`` whose result is RMS-normalised and
``up_proj``-ed back to the hidden size; shared experts (one MLP of width ``moe_intermediate * n_shared``) run on
``x`` and are added. Activation everywhere: SiTU-and-mul (K3) or SiLU-and-mul (Kimi Linear).

Tensor parallelism (PARALLEL_SPEC 1.1-1.2): router, bias and the latent down-projection are replicated; every
routed expert is split on its intermediate dim (``N / tp`` rows of w1/w3, columns of w2; each rank's expert output
is a partial sum), or, with expert parallelism, whole experts are split over the TP ranks (``E / tp`` each; with
data parallelism over the TP x DP ranks of all replicas, ``E / ep``): the
tokens are split over the TP ranks, each rank's picks travel to their expert's rank and back
(:mod:`rocm_k3.model.expert_dispatch`), so each rank runs about ``T x k / tp`` rows and holds the full routed
output of its token slice (zeros elsewhere: again a partial sum for the same reductions). LatentMoE then
all-reduces the ``[T, latent]`` partial (the norm needs the full sum), and each rank adds its ``hidden / tp`` columns of
``up_proj(norm(r))`` into its unreduced shared-expert output before one ``[T, hidden]`` all-reduce: two
collectives per MoE layer. Without a latent (Kimi Linear) routed and shared partials are summed by one.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.checkpoint_errors import CorruptCheckpointError
from rocm_k3.distributed.context import LayoutError, ParallelContext
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.expert_dispatch import combine, combine_static, dispatch, dispatch_static, static_capacity
from rocm_k3.model.expert_placement import ExpertPlacement
from rocm_k3.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    all_reduce,
)
from rocm_k3.model.layers.weights import Read, Target, WeightTargets, new_param
from rocm_k3.ops.devices import device_info
from rocm_k3.ops.moe import ExpertWeights, MoEActivation
from rocm_k3.quant import fp8_dtype_for_arch
from rocm_k3.quant.e8m0 import E8M0_NAN

ACT_QUANT_MODES = ("bf16", "mxfp8")
MXFP4_GROUP = 32


@dataclasses.dataclass(frozen=True)
class ActQuant:
    """Activation format of the routed-expert GEMMs: "bf16" (A16W4, activations as they are) or "mxfp8" (A8W4:
    activations quantised to MXFP8 in ``fp8_dtype``, the format K3's experts were trained for)."""

    mode: str = "bf16"
    fp8_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.mode not in ACT_QUANT_MODES:
            raise ValueError(f"moe_act_quant: expected one of {ACT_QUANT_MODES}, got {self.mode!r}")
        if self.mode == "mxfp8" and self.fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise ValueError(f"fp8_dtype: A8W4 needs torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {self.fp8_dtype}")

    @classmethod
    def for_device(cls, mode: str, device: torch.device) -> ActQuant:
        """``mode`` with the FP8 variant of ``device``'s arch (gfx942: e4m3fnuz; gfx950, NVIDIA, CPU: e4m3fn)."""
        if mode != "mxfp8":
            return cls(mode)
        arch = device_info(device).arch
        return cls(mode, fp8_dtype_for_arch(arch) if arch is not None else torch.float8_e4m3fn)


def activation_for(cfg: ModelConfig) -> MoEActivation:
    if cfg.hidden_act == "situ":
        return MoEActivation("situ", cfg.situ_beta, cfg.situ_linear_beta)
    return MoEActivation("silu")


def act_and_mul(h: torch.Tensor, activation: MoEActivation, table) -> torch.Tensor:
    if activation.kind == "situ":
        return ops.situ_and_mul(h, activation.beta, activation.linear_beta, backend=table)
    return ops.silu_and_mul(h, backend=table)


class DenseMLP(WeightTargets):
    """``down(act(gate(x)) * up(x))``: gate|up merged and column-split, down row-parallel (all-reduced unless
    ``reduce`` is False: the MoE block sums shared experts with its own reduction)."""

    def __init__(self, hidden: int, inter: int, prefix: str, activation: MoEActivation, ctx: ParallelContext, table,
                 *, dtype: torch.dtype, device: torch.device, reduce: bool = True) -> None:
        super().__init__()
        self.activation, self.table = activation, table
        self.gate_up = MergedColumnParallelLinear(hidden, [Shard(prefix + "gate_proj.weight", inter),
                                                           Shard(prefix + "up_proj.weight", inter)],
                                                  ctx, dtype=dtype, device=device)  # [2 I/tp, hidden]
        self.down = RowParallelLinear(inter, hidden, prefix + "down_proj.weight", ctx, table, dtype=dtype,
                                      device=device, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("mlp"):
            return self.down(act_and_mul(self.gate_up(x), self.activation, self.table))  # [T, hidden]


class RoutedExperts(WeightTargets):
    """This rank's routed experts, stacked as the ops want them (checkpoint layout, then re-laid once by the
    serving backend's ``prepare_weights`` after loading: the checkpoint copy is not kept).

    Without EP: all E experts, intermediate rows ``[r N/tp, (r+1) N/tp)``; with EP: physical expert slots
    ``[r P/tp, (r+1) P/tp)`` of the ``P = E + num_redundant_experts`` placed by
    :mod:`rocm_k3.model.expert_placement` (``slots[j]`` = the logical expert slot ``j`` holds), whole.
    """

    def __init__(self, cfg: ModelConfig, prefix: str, ctx: ParallelContext, table, *, dtype: torch.dtype,
                 device: torch.device, layer: int = 0) -> None:
        super().__init__()
        self.cfg, self.ctx, self.table, self.prefix, self.layer = cfg, ctx, table, prefix, layer
        e, n, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_hidden_size
        self.slots: tuple[int, ...] = tuple(range(e))  # logical expert of each physical slot
        self.replicas = None  # [E, max replicas] physical slots of each logical expert (EP)
        self.load = None  # int64 [E]: picks per logical expert, counted under EP (EPLB's load profile)
        if ctx.ep_enabled:
            placement = (ExpertPlacement.read(ctx.expert_placement) if ctx.expert_placement is not None
                         else ExpertPlacement.uniform(e, ctx.num_redundant_experts, ctx.ep_size))
            if (placement.num_experts, placement.ep_size, placement.num_redundant_experts) != \
                    (e, ctx.ep_size, ctx.num_redundant_experts):
                raise LayoutError(f"expert placement for {placement.num_experts} experts + "
                                  f"{placement.num_redundant_experts} redundant over {placement.ep_size} ranks; this "
                                  f"run has {e} + {ctx.num_redundant_experts} over {ctx.ep_size}")
            self.slots = placement.slots(layer)
            self.first, self.count = ctx.shard(len(self.slots), f"{prefix} num_experts + num_redundant_experts "
                                                                f"(expert parallelism)", ctx.ep_size, ctx.ep_rank)
            self.n_local, self.n_start = n, 0
            per = [[s for s, x in enumerate(self.slots) if x == ex] for ex in range(e)]
            width = max(len(p) for p in per)
            self.replicas = torch.tensor([p + [p[0]] * (width - len(p)) for p in per], dtype=torch.int64,
                                         device=device)  # [E, width]
            self.replica_count = torch.tensor([len(p) for p in per], dtype=torch.int64, device=device)  # [E]
            self.load = torch.zeros(e, dtype=torch.int64, device=device)
        else:
            self.first, self.count = 0, e
            self.n_start, self.n_local = ctx.shard(n, f"{prefix} moe_intermediate_size")
        self.fmt = cfg.expert_format
        if self.fmt == "mxfp4" and self.n_local % MXFP4_GROUP:
            raise LayoutError(f"{prefix}: the per-rank expert intermediate size {self.n_local} must be a multiple "
                              f"of the MXFP4 group {MXFP4_GROUP} (moe_intermediate_size {n} / tp {ctx.tp_size})")
        nl, el = self.n_local, self.count
        if self.fmt == "mxfp4":
            u8 = torch.uint8
            self.w13 = new_param((el, 2 * nl, k // 2), u8, device)  # [E_l, 2 N_l, K/2] gate rows then up rows
            self.w13_scale = new_param((el, 2 * nl, k // 32), u8, device)  # [E_l, 2 N_l, K/32]
            self.w2 = new_param((el, k, nl // 2), u8, device)  # [E_l, Kout, N_l/2]
            self.w2_scale = new_param((el, k, nl // 32), u8, device)  # [E_l, Kout, N_l/32]
        else:
            self.w13 = new_param((el, 2 * nl, k), dtype, device)  # [E_l, 2 N_l, K]
            self.w13_scale = self.w2_scale = None
            self.w2 = new_param((el, k, nl), dtype, device)  # [E_l, Kout, N_l]
        self.weights: ExpertWeights | None = None

    def own_targets(self) -> dict[str, Target]:
        out: dict[str, Target] = {}
        nl, n0 = self.n_local, self.n_start
        for j in range(self.count):
            x = f"{self.prefix}experts.{self.slots[self.first + j]}."
            if self.fmt == "mxfp4":
                for w, rows in (("w1", slice(0, nl)), ("w3", slice(nl, 2 * nl))):
                    out[x + f"{w}.weight_packed"] = Target(self.w13[j, rows], Read(0, n0, nl))
                    out[x + f"{w}.weight_scale"] = Target(self.w13_scale[j, rows], Read(0, n0, nl))
                out[x + "w2.weight_packed"] = Target(self.w2[j], Read(1, n0 // 2, nl // 2))
                out[x + "w2.weight_scale"] = Target(self.w2_scale[j], Read(1, n0 // 32, nl // 32))
            else:
                out[x + "w1.weight"] = Target(self.w13[j, :nl], Read(0, n0, nl))
                out[x + "w3.weight"] = Target(self.w13[j, nl:], Read(0, n0, nl))
                out[x + "w2.weight"] = Target(self.w2[j], Read(1, n0, nl))
        return out

    def finish_load(self) -> None:
        if self.fmt == "mxfp4":  # a NaN scale byte would decode to 2^127 on the fast paths (the reference: NaN)
            for name, scales in (("w13", self.w13_scale), ("w2", self.w2_scale)):
                bad = int((scales == E8M0_NAN).sum())
                if bad:
                    raise CorruptCheckpointError(
                        f"{self.prefix}experts: {bad} E8M0 scale byte(s) of the {name} weight_scale tensors are "
                        f"0xFF (NaN); an MXFP4 block with a NaN scale cannot be dequantised")
        # the parameters themselves, not detached views: training reaches them through the reference fused_moe
        raw = ExpertWeights(fmt=self.fmt, w13=self.w13, w13_scale=self.w13_scale, w2=self.w2,
                            w2_scale=self.w2_scale)
        self.weights = ops.prepare_expert_weights(raw, backend=self.table)  # backend layout, once
        if self.weights.layout != "checkpoint":  # re-laid: the backend's tensors are the only copy kept
            for name in ("w13", "w13_scale", "w2", "w2_scale"):
                setattr(self, name, None)

    def forward(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: MoEActivation,
                act_quant: ActQuant, static: bool = False, counted: torch.Tensor | None = None) -> torch.Tensor:
        """``z`` [T, width] through the routed picks (``weights`` fp32 / ``ids`` int32 [T, k], global expert ids)
        -> [T, width], a partial sum under TP / EP (the caller all-reduces it).

        With EP the T tokens (replicated over the TP ranks of a replica) are split into ``tp`` contiguous slices;
        each rank dispatches the picks of its slice to their experts' ranks (over every data-parallel replica) and
        combines them back (:mod:`rocm_k3.model.expert_dispatch`), so each rank runs about ``T x k / ep`` rows of
        the ``T`` tokens of all replicas, and returns the full routed output on its slice, zeros elsewhere: the
        caller's all-reduce stitches the slices. ``T`` = 0 (a replica without work in a step another replica runs)
        sends nothing and still serves the rows the other replicas send to this rank's experts. ``static``: the
        static-capacity dispatch (shapes fixed by T, nothing read on the host: what a decode graph captures; one
        replica only, see ``ParallelContext.static_ep_decode``); ``counted``: bool [T], the rows whose picks count
        in ``load`` (None: every row; a decode graph's padding rows are left out)."""
        ctx = self.ctx
        tokens, top_k = ids.shape
        ctx.add("moe_picks", tokens * top_k)
        if ctx.ep_size == 1:
            ctx.add("moe_rows", tokens * top_k)
            return self._run(z, weights, ids, activation, act_quant)
        picks = (torch.ones_like(self.load[:1]).expand(ids.numel()) if counted is None
                 else counted[:, None].expand(ids.shape).reshape(-1).to(self.load.dtype))  # [T k]
        self.load.index_add_(0, ids.reshape(-1).to(torch.int64), picks)
        lo, hi = ctx.tp_rank * tokens // ctx.tp_size, (ctx.tp_rank + 1) * tokens // ctx.tp_size
        r = z.new_zeros((tokens, z.shape[1]))  # [T, width]
        if static:
            if ctx.dp_size > 1:
                raise ValueError("static expert-parallel dispatch: data-parallel replicas step with different token "
                                 "counts, so their capacities would not match (use the dynamic dispatch)")
            capacity = static_capacity(tokens, ctx.ep_size, top_k)
            held = dispatch_static(z[lo:hi], weights[lo:hi], self.physical(ids[lo:hi], lo), self.count, capacity,
                                   ctx, self.table)
            ctx.add("moe_capacity_rows", held.rows.shape[0])  # ep x capacity: the rows run, picks or not
            out = self._run(held.rows, held.weights, held.ids, activation, act_quant)  # [ep C, width], weighted
            r[lo:hi] = combine_static(out, held.plan, ctx, self.table)
            return r
        sent = dispatch(z[lo:hi], weights[lo:hi], self.physical(ids[lo:hi], lo), self.count, ctx, self.table)
        ctx.add("moe_rows", sent.rows.shape[0])
        if sent.rows.shape[0]:
            out = self._run(sent.rows, sent.weights, sent.ids, activation, act_quant)  # [R, width], weighted
        else:
            out = sent.rows.new_empty((0, z.shape[1]))
        r[lo:hi] = combine(out, sent.plan, ctx, self.table)
        return r

    def physical(self, ids: torch.Tensor, first_token: int) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots: pick ``p`` (counted from the batch's first token) of
        expert ``e`` runs on replica ``p mod replicas(e)`` (all hold ``e``'s weights)."""
        flat = ids.to(torch.int64)  # [T, k]
        pick = torch.arange(ids.numel(), device=ids.device).view(ids.shape) + first_token * ids.shape[1]  # [T, k]
        return self.replicas[flat, pick % self.replica_count[flat]].to(torch.int32)  # [T, k]

    def _run(self, z, weights, ids, activation, act_quant) -> torch.Tensor:
        return ops.fused_moe(z, self.weights, weights, ids, activation=activation, act_quant=act_quant.mode,
                             fp8_dtype=act_quant.fp8_dtype, backend=self.table)


class MoEBlock(WeightTargets):
    """Router + routed experts (optionally LatentMoE) + shared experts; ``forward(x [T, hidden]) -> [T, hidden]``."""

    def __init__(self, cfg: ModelConfig, prefix: str, ctx: ParallelContext, table, act_quant: ActQuant, *,
                 dtype: torch.dtype, device: torch.device, layer: int = 0) -> None:
        super().__init__()
        self.cfg, self.ctx, self.table, self.act_quant = cfg, ctx, table, act_quant
        self.activation = activation_for(cfg)
        hid, e = cfg.hidden_size, cfg.num_experts
        self.router = ReplicatedLinear(hid, e, prefix + "gate.weight", dtype=torch.float32, device=device)
        self.bias = new_param((e,), torch.float32, device)  # [E]
        self.prefix = prefix
        self.experts = RoutedExperts(cfg, prefix, ctx, table, dtype=dtype, device=device, layer=layer)
        self.shared = None
        if cfg.num_shared_experts:
            self.shared = DenseMLP(hid, cfg.moe_intermediate_size * cfg.num_shared_experts, prefix + "shared_experts.",
                                   self.activation, ctx, table, dtype=dtype, device=device, reduce=False)
        self.latent = cfg.routed_expert_hidden_size is not None
        self.latent_down = self.latent_up = None
        self.latent_norm = None
        if self.latent:
            lat = cfg.routed_expert_hidden_size
            self.latent_down = ReplicatedLinear(hid, lat, prefix + "routed_expert_down_proj.weight", dtype=dtype,
                                                device=device)
            # the up-projection's output columns are split: each rank writes its hidden/tp slice (see module doc)
            self.latent_up = ColumnParallelLinear(lat, hid, prefix + "routed_expert_up_proj.weight", ctx,
                                                  dtype=dtype, device=device)
            if cfg.latent_moe_use_norm:
                self.latent_norm = new_param((lat,), dtype, device)  # [latent]

    def own_targets(self) -> dict[str, Target]:
        out = {self.prefix + "gate.e_score_correction_bias": Target(self.bias)}
        if self.latent_norm is not None:
            out[self.prefix + "routed_expert_norm.weight"] = Target(self.latent_norm)
        return out

    def forward(self, x: torch.Tensor, static_dispatch: bool = False,
                counted: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [T, hidden] -> [T, hidden]; ``static_dispatch``: expert-parallel picks travel on the
        static-capacity path (decode steps, see :mod:`rocm_k3.model.expert_dispatch`); ``counted``: bool [T], the
        rows counted in the experts' load (None: all)."""
        with record_function("moe"):
            return self._forward(x, static_dispatch, counted)

    def idle(self, device: torch.device, dtype: torch.dtype) -> None:
        """This layer in a step without tokens of this rank's data-parallel replica: zero picks through the
        expert-parallel dispatch, so the collectives of the replicas that step match, and this rank's experts run
        the rows they send here."""
        k = self.cfg.num_experts_per_token
        z = torch.empty((0, self.cfg.expert_hidden_size), dtype=dtype, device=device)  # [0, expert width]
        weights = torch.empty((0, k), dtype=torch.float32, device=device)  # [0, k]
        ids = torch.empty((0, k), dtype=torch.int32, device=device)  # [0, k]
        self.experts(z, weights, ids, self.activation, self.act_quant)

    def _forward(self, x: torch.Tensor, static_dispatch: bool, counted: torch.Tensor | None) -> torch.Tensor:
        cfg, ctx, table = self.cfg, self.ctx, self.table
        logits = self.router(x.float())  # fp32 [T, E]
        routed = ops.route(logits, cfg.num_experts_per_token, correction_bias=self.bias,
                           renormalize=cfg.moe_renormalize, scaling_factor=cfg.routed_scaling_factor, backend=table)
        z = x if self.latent_down is None else self.latent_down(x)  # [T, expert width]
        r = self.experts(z, routed.weights, routed.ids, self.activation, self.act_quant,
                         static_dispatch, counted)  # [T, expert width]
        shared = self.shared(x) if self.shared is not None else None  # [T, hidden]; partial under TP
        if not self.latent:
            y = r if shared is None else r + shared
            return all_reduce(y, ctx, table, "moe_all_reduce")
        r = all_reduce(r, ctx, table, "moe_latent_all_reduce")  # the norm needs the full latent sum
        if self.latent_norm is not None:
            r = ops.rms_norm(r, self.latent_norm, cfg.rms_norm_eps, backend=table)
        up = self.latent_up(r)  # [T, hidden / tp]: this rank's columns
        if ctx.tp_size == 1:
            return up if shared is None else up + shared
        out = shared if shared is not None else torch.zeros_like(x)
        start = ctx.tp_rank * up.shape[1]
        out = out.clone()
        out[:, start : start + up.shape[1]] += up
        return all_reduce(out, ctx, table, "moe_all_reduce")
