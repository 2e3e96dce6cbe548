"""The KDA layer as vLLM's state layer: rocm-k3's :class:`~rocm_k3.model.kda.KDALayer` (its weights and ops) over
the conv and recurrent state pools vLLM allocates, driven by vLLM's per-step state metadata.

vLLM gives each KDA layer two pools (:meth:`KDAStateLayer.get_state_shape`), indexed by state slot: the short-conv
state ``[S, 3 Hl D, W-1]`` (oldest input first, the model dtype) and the recurrent state fp32 ``[S, Hl, D, D]``,
the layouts rocm-k3's ops take. A step's metadata (:mod:`.kda_backend`) puts the decodes first: their slots are
``state_indices_tensor_d[:, 0]``; the prefills' (new sequences and later chunks of chunked prefills) are
``state_indices_tensor_p`` with ``query_start_loc_p`` (offsets into the prefill tokens) and
``has_initial_states_p``. With prefix caching ('align' mode) vLLM copies a cached block's states into the
running slot before the step (the model's copy functions) and schedules block-aligned chunks, so the layer only
ever reads and writes the running slot. The metadata is None in vLLM's profile and dummy runs.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase

from rocm_k3.integrations.vllm.kda_backend import register_backend
from rocm_k3.model.forward_batch import ForwardBatch
from rocm_k3.model.kda import KDALayer


def state_shapes(num_heads: int, head_dim: int, conv_kernel_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-slot shapes of one KDA layer's (conv, recurrent) states for ``num_heads`` local heads."""
    return (3 * num_heads * head_dim, conv_kernel_size - 1), (num_heads, head_dim, head_dim)


class _StatePools:
    """The two pools of one layer as the :class:`~rocm_k3.model.forward_batch.HybridCacheView` KDA reads."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent

    def kda_state(self, _index: int) -> torch.Tensor:
        return self.recurrent

    def conv_state(self, _index: int) -> torch.Tensor:
        return self.conv


def kda_batch(cu_seqlens: torch.Tensor, slots: torch.Tensor, has_initial: torch.Tensor, *,
              is_decode: bool) -> ForwardBatch:
    """The part of a :class:`ForwardBatch` a KDA layer reads, for sequences at ``cu_seqlens`` (the other fields
    are shaped placeholders: KDA uses no positions, pages or logits rows)."""
    dev = cu_seqlens.device
    n, t = slots.shape[0], int(cu_seqlens[-1])
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=dev), positions=torch.zeros(t, dtype=torch.int64, device=dev),
        cu_seqlens=cu_seqlens.to(torch.int32), seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
        block_table=torch.zeros(n, 1, dtype=torch.int32, device=dev),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev), kda_slots=slots.to(torch.int32),
        has_initial_state=has_initial.to(torch.bool), logits_indices=torch.zeros(0, dtype=torch.int64, device=dev),
        is_decode=is_decode,
    )


class KDAStateLayer(nn.Module, MambaBase):
    """``forward(x [T, hidden], *_) -> [T, hidden]``: one KDA sublayer under vLLM (registered as ``prefix``)."""

    def __init__(self, kda: KDALayer, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.kda, self.prefix = kda, prefix
        cfg = kda.cfg
        self._shapes = state_shapes(kda.heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size)
        self._dtypes = (vllm_config.model_config.dtype, torch.float32)
        self._type = register_backend()
        static = vllm_config.compilation_config.static_forward_context
        if prefix in static:
            raise ValueError(f"duplicate layer name {prefix!r} in vLLM's forward context")
        static[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self._shapes

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return self._dtypes

    @property
    def mamba_type(self):
        return self._type

    def forward(self, x: torch.Tensor, *_unused) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            raise ValueError("rocm-k3's vLLM plugin: micro-batched steps (a list of metadata) are not supported")
        meta = None if metadata is None else metadata.get(self.prefix)
        out = torch.zeros_like(x)
        if meta is None:  # profile / dummy run: no state slots
            return out
        pools = _StatePools(*self.kv_cache)
        nd, npf = meta.num_decode_tokens, meta.num_prefill_tokens
        dev = x.device
        if meta.num_decodes:
            slots = meta.state_indices_tensor_d[:, 0]
            cu = torch.arange(nd + 1, dtype=torch.int32, device=dev)
            batch = kda_batch(cu, slots, torch.ones(nd, dtype=torch.bool, device=dev), is_decode=True)
            out[:nd] = self.kda(x[:nd], batch, pools)
        if meta.num_prefills:
            batch = kda_batch(meta.query_start_loc_p, meta.state_indices_tensor_p, meta.has_initial_states_p,
                              is_decode=False)
            out[nd:nd + npf] = self.kda(x[nd:nd + npf], batch, pools)
        return out
