"""The Kimi K3 / Kimi Linear text model: embedding, the hybrid KDA/MLA decoder stack, final norm, LM head.

``KimiModel.forward(batch, cache) -> logits fp32 [N, vocab]`` runs one engine step described by a
:class:`~rocm_k3.model.forward_batch.ForwardBatch` over any :class:`~rocm_k3.model.forward_batch.HybridCacheView`.
The residual stream is Attention Residuals (K3, :mod:`rocm_k3.model.attn_res`) when ``attn_res_block_size`` is
set, else the plain pre-norm residual (Kimi Linear). Weights are built once from canonical checkpoint tensors
(see :mod:`rocm_k3.model.checkpoint_names`) with the fusions the ops want.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping

import torch
import torch.nn.functional as F

from rocm_k3 import ops
from rocm_k3.ops.registry import OpTable, bind
from rocm_k3.model.attn_res import AttnResLayer, AttnResSite, attn_res_stack
from rocm_k3.model.checkpoint_names import layer_prefix
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView
from rocm_k3.model.kda import KDALayer, KDAWeights
from rocm_k3.model.mla import MLALayer, MLAWeights
from rocm_k3.model.moe import ActQuant, DenseMLP, MoEBlock, activation_for


@dataclasses.dataclass
class DecoderLayer:
    """One layer: token mixer (KDA or MLA), feed-forward (dense MLP or MoE), norms, optional AttnRes sites."""

    index: int
    attn: KDALayer | MLALayer
    ffn: DenseMLP | MoEBlock
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_site: AttnResSite | None
    mlp_site: AttnResSite | None


class KimiModel:
    """The text model. ``dtype`` is the activation/weight dtype; ``backend`` (the bound :class:`OpTable`) is
    passed to every op call."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, output_site: AttnResSite | None, backend: OpTable | str | None) -> None:
        if len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"layers: expected {cfg.num_hidden_layers}, got {len(layers)}")
        self.cfg = cfg
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [vocab, hidden]
        self.output_site = output_site
        self.backend = backend

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: MutableMapping[str, torch.Tensor],
                     backend: OpTable | str | None = None, moe_act_quant: str = "bf16") -> KimiModel:
        """Build from canonical-name tensors (already validated, cast and placed); consumes ``tensors``.

        moe_act_quant: "bf16" (A16W4) or "mxfp8" (A8W4, FP8 variant of the tensors' device) for routed experts.
        backend: a backend name (None: settings / auto); the ops are bound once for the tensors' device
        (:func:`rocm_k3.ops.registry.bind`) and every layer calls the bound table.
        """
        device = tensors["model.embed_tokens.weight"].device
        act_quant = ActQuant.for_device(moe_act_quant, device)
        table = backend if isinstance(backend, OpTable) else bind(device, backend)
        backend = table

        def take(prefix: str) -> dict[str, torch.Tensor]:
            names = [n for n in tensors if n.startswith(prefix)]
            return {n[len(prefix):]: tensors.pop(n) for n in names}

        layers = []
        for index in range(cfg.num_hidden_layers):
            p = layer_prefix(index)
            attn_t = take(p + "self_attn.")
            if cfg.is_mla_layer(index):
                attn: KDALayer | MLALayer = MLALayer(cfg, MLAWeights.from_checkpoint(cfg, attn_t),
                                                     cfg.layer_slot(index), backend)
            else:
                attn = KDALayer(cfg, KDAWeights.from_checkpoint(cfg, attn_t), cfg.layer_slot(index), backend)
            if cfg.is_moe_layer(index):
                ffn: DenseMLP | MoEBlock = MoEBlock.from_checkpoint(cfg, take(p + "block_sparse_moe."), backend,
                                                                  act_quant)
            else:
                ffn = DenseMLP.from_checkpoint(take(p + "mlp."), activation_for(cfg), backend)
            sites = [None, None]
            if cfg.uses_attn_res:
                sites = [AttnResSite.from_checkpoint(tensors.pop(p + f"{s}_proj.weight"),
                                                     tensors.pop(p + f"{s}_norm.weight"))
                         for s in ("self_attention_res", "mlp_res")]
            layers.append(DecoderLayer(index, attn, ffn, tensors.pop(p + "input_layernorm.weight"),
                                       tensors.pop(p + "post_attention_layernorm.weight"), *sites))
        embed = tensors.pop("model.embed_tokens.weight")
        lm_head = embed if cfg.tie_word_embeddings else tensors.pop("lm_head.weight")
        output_site = None
        if cfg.uses_attn_res:
            output_site = AttnResSite.from_checkpoint(tensors.pop("model.output_attn_res_proj.weight"),
                                                      tensors.pop("model.output_attn_res_norm.weight"))
        model = cls(cfg, embed, layers, tensors.pop("model.norm.weight"), lm_head, output_site, backend)
        if tensors:
            raise ValueError(f"tensors not used by the model: {sorted(tensors)[:10]}")
        return model

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        """One step: logits fp32 [N, vocab] at ``batch.logits_indices``."""
        hidden = self.hidden_states(batch, cache)  # [T, hidden], final-normed
        return F.linear(hidden[batch.logits_indices], self.lm_head).float()  # [N, vocab]

    def hidden_states(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        """Final-normed hidden states of every new token, [T, hidden]."""
        if batch.input_ids.device != self.device:
            raise ValueError(f"batch tensors are on {batch.input_ids.device}, the model on {self.device}")
        h0 = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        cfg = self.cfg
        if cfg.uses_attn_res:
            stack = [AttnResLayer(layer.attn_site, layer.mlp_site, layer.input_norm, layer.post_norm,
                                  self._attn_fn(layer, batch, cache), layer.ffn.forward) for layer in self.layers]
            return attn_res_stack(h0, stack, cfg.attn_res_block_size, self.output_site, self.final_norm,
                                  cfg.rms_norm_eps, self.backend)
        return self._residual_stack(h0, batch, cache)

    def _residual_stack(self, h0: torch.Tensor, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor:
        """Plain pre-norm residual: ``h += Attn(norm_in(h)); h += MLP(norm_post(h))``; then the final norm."""
        eps, backend = self.cfg.rms_norm_eps, self.backend
        residual = h0
        x = ops.rms_norm(h0, self.layers[0].input_norm, eps, backend=backend)
        for i, layer in enumerate(self.layers):
            a = layer.attn.forward(x, batch, cache)
            x, residual = ops.add_rms_norm(a, residual, layer.post_norm, eps, backend=backend)
            m = layer.ffn.forward(x)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, residual = ops.add_rms_norm(m, residual, next_norm, eps, backend=backend)
        return x

    @staticmethod
    def _attn_fn(layer: DecoderLayer, batch: ForwardBatch,
                 cache: HybridCacheView) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: layer.attn.forward(x, batch, cache)
