"""The Kimi K3 / Kimi Linear text model as ``nn.Module`` s built from ``(config, ParallelContext, OpTable)``.

``KimiModel.forward(batch, cache) -> logits fp32 [N, vocab]`` runs one engine step described by a
:class:`~rocm_k3.model.forward_batch.ForwardBatch` over any :class:`~rocm_k3.model.forward_batch.HybridCacheView`.
Under pipeline parallelism the model holds one stage: a contiguous range of layers (:func:`stage_layers`), the
embedding on the first stage, the final norm and LM head on the last; :meth:`KimiModel.forward_stage` takes the
previous stage's :class:`~rocm_k3.model.attn_res.StackState` and returns the state for the next (or the logits).
The residual stream is Attention Residuals (K3) when ``attn_res_block_size`` is set, else the plain pre-norm
residual (Kimi Linear), replicated on every TP rank. Each checkpoint tensor lands in its parameter through the
layers' shard rules (``weight_targets``); see :mod:`rocm_k3.model.loader`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rocm_k3.distributed.context import LayoutError, ParallelContext
from rocm_k3.model.attn_res import AttnResSite, StackState, finish, run_layers
from rocm_k3.model.checkpoint_names import layer_prefix
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.model.kda import KDALayer
from rocm_k3.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rocm_k3.model.layers.weights import Target, WeightTargets, new_param
from rocm_k3.model.mla import MLALayer
from rocm_k3.model.moe import ActQuant, DenseMLP, MoEBlock, activation_for
from rocm_k3.model.vision.prompt import scatter_image_embeddings
from rocm_k3.ops.registry import OpTable


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` so that device comparisons with the step's tensors hold."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, block_size: int | None) -> range:
    """The layers of pipeline stage ``pp_rank``: contiguous, near-equal, with boundaries moved to a multiple of
    the AttnRes block size when that keeps every stage non-empty (the bank then crosses with whole blocks)."""
    if pp_size > num_layers:
        raise LayoutError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    bounds = [round(num_layers * s / pp_size) for s in range(pp_size + 1)]
    if block_size:
        snapped = [bounds[0]] + [round(b / block_size) * block_size for b in bounds[1:-1]] + [bounds[-1]]
        if all(a < b for a, b in zip(snapped, snapped[1:])):
            bounds = snapped
    return range(bounds[pp_rank], bounds[pp_rank + 1])


class DecoderLayer(WeightTargets):
    """One layer: token mixer (KDA or MLA), feed-forward (dense MLP or MoE), norms, optional AttnRes sites."""

    def __init__(self, cfg: ModelConfig, index: int, cache_index: int, ctx: ParallelContext, table: OpTable,
                 act_quant: ActQuant, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.index = index
        p = layer_prefix(index)
        kw = {"dtype": dtype, "device": device}
        mixer = MLALayer if cfg.is_mla_layer(index) else KDALayer
        self.attn = mixer(cfg, ctx, table, p + "self_attn.", cache_index, **kw)
        if cfg.is_moe_layer(index):
            self.ffn: DenseMLP | MoEBlock = MoEBlock(cfg, p + "block_sparse_moe.", ctx, table, act_quant, layer=index,
                                                        **kw)
        else:
            self.ffn = DenseMLP(cfg.hidden_size, cfg.intermediate_size, p + "mlp.", activation_for(cfg), ctx, table,
                                **kw)
        hid = cfg.hidden_size
        self.input_norm = new_param((hid,), dtype, device)
        self.post_norm = new_param((hid,), dtype, device)
        self.names = (p + "input_layernorm.weight", p + "post_attention_layernorm.weight")
        self.attn_site = self.mlp_site = None
        if cfg.uses_attn_res:
            self.attn_site = AttnResSite(hid, p + "self_attention_res_proj.weight",
                                         p + "self_attention_res_norm.weight", **kw)
            self.mlp_site = AttnResSite(hid, p + "mlp_res_proj.weight", p + "mlp_res_norm.weight", **kw)
        self._batch: ForwardBatch | None = None
        self._cache: HybridCacheView | None = None

    def own_targets(self) -> dict[str, Target]:
        return {self.names[0]: Target(self.input_norm), self.names[1]: Target(self.post_norm)}

    def bind_step(self, batch: ForwardBatch, cache: HybridCacheView) -> None:
        self._batch, self._cache = batch, cache

    def attn_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, self._batch, self._cache)

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        if isinstance(self.ffn, MoEBlock) and batch is not None:  # decode steps: static-capacity EP dispatch
            # a decode's rows all continue a sequence (position >= 1): position 0 marks a graph bucket's padding,
            # whose picks are no load
            counted = batch.positions > 0 if batch.is_decode and self.ffn.experts.load is not None else None
            return self.ffn(x, batch.is_decode and self.ffn.ctx.static_dispatch_for(batch.graphed), counted)
        return self.ffn(x)


class KimiModel(WeightTargets):
    """The text model, or one pipeline stage of it (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, table: OpTable, *, dtype: torch.dtype,
                 device: torch.device, moe_act_quant: str = "bf16") -> None:
        super().__init__()
        self.cfg, self.ctx, self.backend = cfg, ctx, table
        self._dtype, self._device = dtype, _with_index(torch.device(device))
        self.layer_range = stage_layers(cfg.num_hidden_layers, ctx.pp_size, ctx.pp_rank, cfg.attn_res_block_size)
        act_quant = ActQuant.for_device(moe_act_quant, self._device)
        kw = {"dtype": dtype, "device": self._device}
        mla_seen = kda_seen = 0
        layers = []
        for index in self.layer_range:
            if cfg.is_mla_layer(index):
                cache_index, mla_seen = mla_seen, mla_seen + 1
            else:
                cache_index, kda_seen = kda_seen, kda_seen + 1
            layers.append(DecoderLayer(cfg, index, cache_index, ctx, table, act_quant, **kw))
        self.layers = nn.ModuleList(layers)
        self.num_mla_layers, self.num_kda_layers = mla_seen, kda_seen
        self.embed = None
        if ctx.is_first_stage or cfg.tie_word_embeddings:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, "model.embed_tokens.weight", ctx,
                                                table, **kw)
        # speculative drafting (set by the worker): tapped depths, 0..num_hidden_layers - 1 = that layer's normed
        # attention input, num_hidden_layers = the final-normed hidden state; each forward of a single-stage model
        # then leaves ``tapped`` [N, len(tap_layers), hidden] at the logits rows. With ``tap_outputs`` (a DSpark
        # drafter) depth i is instead the residual stream after layer i (AttnRes: the current block's partial
        # sum), i in 0..num_hidden_layers - 1, and ``tapped`` [T, len(tap_layers), hidden] holds every token row
        # (in a decode-shaped batch: every logits row, which are its token rows)
        self.tap_layers: tuple[int, ...] = ()
        self.tap_outputs = False
        self.tapped: torch.Tensor | None = None
        self.final_norm = self.lm_head = self.output_site = None
        if ctx.is_last_stage:
            self.final_norm = new_param((cfg.hidden_size,), dtype, self._device)
            tied = self.embed if cfg.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, "lm_head.weight", ctx, table, tied=tied,
                                          **kw)
            if cfg.uses_attn_res:
                self.output_site = AttnResSite(cfg.hidden_size, "model.output_attn_res_proj.weight",
                                               "model.output_attn_res_norm.weight", **kw)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def own_targets(self) -> dict[str, Target]:
        return {"model.norm.weight": Target(self.final_norm)} if self.final_norm is not None else {}

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        """One step of a single-stage model: logits fp32 [N, vocab] at ``batch.logits_indices``."""
        if not (self.ctx.is_first_stage and self.ctx.is_last_stage):
            raise RuntimeError("forward: this model is one pipeline stage; use forward_stage")
        return self.forward_stage(batch, cache, None)

    def forward_stage(self, batch: ForwardBatch, cache: HybridCacheView,
                      state: StackState | None) -> torch.Tensor | StackState:
        """Run this stage: from the embeddings (first stage, ``state`` None) or the previous stage's state; the
        last stage returns logits fp32 [N, vocab], the others the state to send on."""
        if batch.input_ids.device != self.device:
            raise ValueError(f"batch tensors are on {batch.input_ids.device}, the model on {self.device}")
        with torch.inference_mode():
            cfg = self.cfg
            if state is None:
                if self.embed is None or not self.ctx.is_first_stage:
                    raise RuntimeError("forward_stage: a stage after the first needs the previous stage's state")
                state = StackState.start(self.embed_inputs(batch), cfg.num_hidden_layers, cfg.attn_res_block_size)
            for layer in self.layers:
                layer.bind_step(batch, cache)
            taps: dict[int, torch.Tensor] = {}
            wanted = set(self.tap_layers)

            def tap(index: int, x: torch.Tensor) -> None:
                if index in wanted:
                    taps[index] = x[batch.logits_indices]  # [N, hidden]

            # a decode-shaped batch (graph or verification layout) may hold padding rows: its token rows are its
            # logits rows there; any other batch's rows are its tokens
            token_rows = batch.logits_indices if batch.is_decode else None

            def out_tap(index: int, running: torch.Tensor | None, delta: torch.Tensor) -> None:
                if index in wanted:
                    stream = delta if running is None else running + delta  # [T, hidden]
                    taps[index] = stream.clone() if token_rows is None else stream[token_rows]

            outputs = bool(wanted) and self.tap_outputs
            state = run_layers(state, list(self.layers), cfg.attn_res_block_size, cfg.rms_norm_eps, self.backend,
                               tap if wanted and not outputs else None, out_tap if outputs else None)
            if not self.ctx.is_last_stage:
                return state
            hidden = finish(state, self.output_site, self.final_norm, cfg.rms_norm_eps, self.backend)  # [T, hidden]
            out = hidden[batch.logits_indices]  # [N, hidden]
            if outputs:
                self.tapped = torch.stack([taps[i] for i in self.tap_layers], dim=1)  # [T, len(tap_layers), hidden]
            elif wanted:
                taps[cfg.num_hidden_layers] = out
                self.tapped = torch.stack([taps[i] for i in self.tap_layers], dim=1)  # [N, len(tap_layers), hidden]
            return self.lm_head(out)  # [N, vocab]

    def embed_inputs(self, batch: ForwardBatch) -> torch.Tensor:
        """The input embeddings [T, hidden] of the step: the token embeddings, with ``batch.image_embeds`` at rows
        ``batch.image_rows`` (the ``<|media_pad|>`` positions) instead of the pad token's embedding."""
        x = self.embed(batch.input_ids)  # [T, hidden]
        if batch.image_embeds is not None:
            x = scatter_image_embeddings(x, batch.image_rows, batch.image_embeds)
        return x

    def hidden_states(self, batch: ForwardBatch, cache: HybridCacheView, *, autograd: bool = False) -> torch.Tensor:
        """Final-normed hidden states of every new token, [T, hidden] (single-stage model).

        autograd: record the graph instead of running in inference mode (training, with the reference ops)."""
        with torch.inference_mode(not autograd):
            cfg = self.cfg
            state = StackState.start(self.embed_inputs(batch), cfg.num_hidden_layers, cfg.attn_res_block_size)
            for layer in self.layers:
                layer.bind_step(batch, cache)
            state = run_layers(state, list(self.layers), cfg.attn_res_block_size, cfg.rms_norm_eps, self.backend)
            return finish(state, self.output_site, self.final_norm, cfg.rms_norm_eps, self.backend)

    def state_shapes(self, num_tokens: int) -> list[tuple[int, ...]]:
        """Shapes of the tensors a stage boundary carries for a step of ``num_tokens`` tokens."""
        hid = self.cfg.hidden_size
        if self.cfg.uses_attn_res:
            blocks = math.ceil(self.cfg.num_hidden_layers / self.cfg.attn_res_block_size)
            return [(num_tokens, hid), (num_tokens, hid), (blocks, num_tokens, hid)]
        return [(num_tokens, hid), (num_tokens, hid)]
