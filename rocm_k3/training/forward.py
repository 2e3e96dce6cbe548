"""The training forward: the serving model's own modules, trained in place, run with autograd over rows.

:func:`training_model` builds the :class:`~rocm_k3.model.decoder.KimiModel` of a config (routed experts dense,
fp32, the ``reference`` op table), fills it from tensors by checkpoint name (``cfg.weight_prefix`` + canonical
name) through the loader's targets and unfreezes its parameters (all but the router's selection bias);
:func:`checkpoint_tensors_of` reads them back by checkpoint name. :func:`forward_logits` runs one prefill of B
rows, each a sequence starting at position 0, over fresh cache pools (:class:`~rocm_k3.worker.kv_pools.KVPools`)
with the graph recorded, so the loss's gradients reach the model's parameters through the code that serves it:
the reference ops are differentiable (the KDA chunk inverse is a triangular solve; the AttnRes mix keeps copies
of the sources it reads, since the bank is written again later). Right padding only affects the padded
positions (everything is causal).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.checkpoint_names import expected_tensors
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.decoder import KimiModel
from rocm_k3.model.forward_batch import ForwardBatch
from rocm_k3.model.loader import fill_target
from rocm_k3.model.moe import MoEBlock
from rocm_k3.ops.registry import bind
from rocm_k3.training.params import dense_expert_config, is_trainable, stored_shape
from rocm_k3.worker.kv_pools import KVPools, PoolShapes

BLOCK_SIZE = 64  # MLA page size of the training cache (any size gives the same logits)


def training_model(cfg: ModelConfig, params: Mapping[str, torch.Tensor],
                   device: str | torch.device = "cpu") -> KimiModel:
    """The fp32 model of ``cfg`` (dense experts, reference ops) on ``device`` holding ``params`` (checkpoint name ->
    tensor, dense experts), with every parameter trainable except those of frozen tensors (the router bias)."""
    dense = dense_expert_config(cfg)
    model = KimiModel(dense, ParallelContext.single(), bind(device, "reference"), dtype=torch.float32,
                      device=device)
    frozen: dict[int, bool] = {}
    for canon, target in model.weight_targets().items():
        fill_target(dense, canon, canon, target, params[cfg.weight_prefix + canon])
        key = _storage(target.dst)
        frozen[key] = frozen.get(key, True) and not is_trainable(canon)
    model.post_load()
    for p in model.parameters():
        p.requires_grad_(not frozen.get(_storage(p), True))
    return model


def checkpoint_tensors_of(model: KimiModel, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The model's tensors (or, with ``grads``, their gradients; zeros where none) by checkpoint name, fp32 on the
    CPU in the shapes the checkpoint stores (:func:`~rocm_k3.training.params.stored_shape`)."""
    cfg = model.cfg
    specs = expected_tensors(cfg)
    owner = {_storage(p): p for p in model.parameters()}
    out = {}
    for canon, target in model.weight_targets().items():
        t = target.dst
        if grads:
            p = owner[_storage(t)]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            t = g.as_strided(t.shape, t.stride(), g.storage_offset() + t.storage_offset() - p.storage_offset())
        flat = t.detach().float().cpu().reshape(-1)
        shape = stored_shape(cfg, canon, specs[canon].shape)
        full = torch.zeros(math.prod(shape))
        full[:flat.numel()] = flat
        out[cfg.weight_prefix + canon] = full.reshape(shape)
    return out


def decayed_parameters(model: KimiModel) -> list[nn.Parameter]:
    """The trainable parameters filled from the checkpoint's matrices (2-D tensors other than the AttnRes
    projections): the ones AdamW decays."""
    specs = expected_tensors(model.cfg)
    matrix: dict[int, bool] = {}
    for canon, target in model.weight_targets().items():
        key = _storage(target.dst)
        is_matrix = len(specs[canon].shape) == 2 and not canon.endswith("_res_proj.weight")
        matrix[key] = matrix.get(key, True) and is_matrix
    return [p for p in model.parameters() if p.requires_grad and matrix.get(_storage(p), False)]


def forward_logits(model: KimiModel, input_ids: torch.Tensor, *,
                   expert_counts: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits fp32 [B, L, vocab] at every position of ``input_ids`` int64 [B, L] (a training model's).

    expert_counts: if given, filled with MoE layer -> int64 [E] tokens routed to each expert (all positions).
    """
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids: expected int64 [B, L], got {input_ids.dtype} {list(input_ids.shape)}")
    rows, length = input_ids.shape
    hooks = _count_experts(model, expert_counts) if expert_counts is not None else []
    try:
        pools = KVPools(PoolShapes.from_model(model, torch.float32), block_size=BLOCK_SIZE,
                        num_blocks=rows * math.ceil(length / BLOCK_SIZE), num_slots=rows, device=input_ids.device)
        hidden = model.hidden_states(_prefill_batch(input_ids), pools, autograd=True)  # [B * L, hidden]
    finally:
        for hook in hooks:
            hook.remove()
    return model.lm_head(hidden).reshape(rows, length, -1)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _prefill_batch(input_ids: torch.Tensor) -> ForwardBatch:
    """One prefill step of B rows of L tokens from position 0: row b owns pages ``b * P ..`` and KDA slot b."""
    rows, length = input_ids.shape
    dev = input_ids.device
    pages = math.ceil(length / BLOCK_SIZE)
    pos = torch.arange(length, device=dev)  # [L]
    row = torch.arange(rows, device=dev)  # [B]
    return ForwardBatch(
        input_ids=input_ids.reshape(-1),
        positions=pos.repeat(rows),
        cu_seqlens=(torch.arange(rows + 1, device=dev) * length).to(torch.int32),
        seq_lens=torch.full((rows,), length, dtype=torch.int32, device=dev),
        block_table=torch.arange(rows * pages, device=dev).reshape(rows, pages).to(torch.int32),
        slot_mapping=(row[:, None] * pages * BLOCK_SIZE + pos).reshape(-1),
        kda_slots=row.to(torch.int32),
        has_initial_state=torch.zeros(rows, dtype=torch.bool, device=dev),
        logits_indices=torch.arange(rows * length, device=dev),
    )


def _count_experts(model: KimiModel, counts: dict[int, torch.Tensor]) -> list:
    """Hooks that record each MoE layer's routed picks per expert (the ids its routed experts receive)."""
    hooks = []
    for layer in model.layers:
        if isinstance(layer.ffn, MoEBlock):
            def record(_module, args, index=layer.index, num=model.cfg.num_experts) -> None:
                ids = args[2]  # RoutedExperts.forward(z, weights, ids, activation, act_quant): int32 [T, k]
                counts[index] = torch.bincount(ids.reshape(-1).long(), minlength=num)

            hooks.append(layer.ffn.experts.register_forward_pre_hook(record))
    return hooks
