"""The residual dataflow over the decoder stack: Attention Residuals (K3_SPEC section 5) or the plain pre-norm
residual, run over any contiguous range of layers so a pipeline stage can continue where the previous one ended.

AttnRes: per token the stack keeps a bank of block snapshots ``blocks [B_max, T, hidden]`` (b_0 = the embedding,
one snapshot at every layer l with ``l % B == 0``) and the running partial sum ``p`` of the current block. Each
sublayer input is a learned softmax mix over ``[b_0 .. b_{n-1}, p]`` followed by that sublayer's RMSNorm; the
fused op :func:`rocm_k3.ops.attn_res_step` does ``p += delta``, the optional snapshot, the mix and the norm::

    layer l:  nb = ceil(l / B)
              x, p = step(p, mlp_out_{l-1}, blocks, nb, write = l % B == 0, attn site, input_layernorm)
              if l % B == 0: p = None                       # the finished block was snapshotted
              a = Attn(x)
              x, p = step(p, a, blocks, nb + (l % B == 0), write = False, mlp site, post_attention_layernorm)
              m = MLP(x)
    final:    h, _ = step(p, m_last, blocks, B_max, write = False, output site, final norm)

Plain residual (Kimi Linear): ``h += Attn(norm_in(h)); h += MLP(norm_post(h))``, the adds fused into the next
norm. Between layers (and across a pipeline boundary) the state is :class:`StackState`: the running sum
(AttnRes partial / plain residual), the last MLP output not yet added, and the AttnRes bank. The bank lives for
one forward pass only; it is not part of the cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rocm_k3 import ops
from rocm_k3.model.layers.weights import Read, Target, WeightTargets, new_param


class AttnResSite(WeightTargets):
    """The weights of one mixing site: ``proj [hidden]`` (the checkpoint's ``[1, hidden]`` row), ``norm [hidden]``."""

    def __init__(self, hidden: int, proj_name: str, norm_name: str, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.names = (proj_name, norm_name)
        self.proj = new_param((hidden,), dtype, device)
        self.norm = new_param((hidden,), dtype, device)

    def own_targets(self) -> dict[str, Target]:
        return {self.names[0]: Target(self.proj, Read(transform=lambda t: t.reshape(-1))),
                self.names[1]: Target(self.norm)}


class StackLayer(Protocol):
    """What the dataflow needs from one decoder layer (``index`` is its global depth)."""

    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_site: AttnResSite | None
    mlp_site: AttnResSite | None

    def attn_forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclasses.dataclass
class StackState:
    """The stream between two layers: ``running`` (AttnRes partial p, or the plain residual h), ``delta`` (the
    last MLP output, not yet added; None before layer 0) and ``blocks`` (the AttnRes bank, None without)."""

    running: torch.Tensor
    delta: torch.Tensor | None = None
    blocks: torch.Tensor | None = None

    @classmethod
    def start(cls, h0: torch.Tensor, num_layers: int, block_size: int | None) -> StackState:
        """The state before layer 0 from the embeddings ``h0 [T, hidden]``."""
        if block_size is None:
            return cls(h0)
        if block_size <= 0:
            raise ValueError(f"attn_res_block_size: expected a positive int, got {block_size}")
        blocks = h0.new_empty(math.ceil(num_layers / block_size), *h0.shape)  # [B_max, T, hidden]
        return cls(h0, None, blocks)


Tap = Callable[[int, torch.Tensor], None]  # (layer index, its normed attention input [T, hidden])
# (layer index, the stream after that layer as (running [T, hidden] or None, delta [T, hidden]): running + delta is
# the residual stream after the layer (AttnRes: the current block's partial sum), what a DSpark drafter reads)
OutTap = Callable[[int, "torch.Tensor | None", torch.Tensor], None]


def run_layers(state: StackState, layers: Sequence[StackLayer], block_size: int | None, eps: float,
               table, tap: Tap | None = None, out_tap: OutTap | None = None) -> StackState:
    """Run ``layers`` (consecutive depths) from ``state``; returns the state after the last of them. ``tap``, if
    given, sees each layer's normed attention input (what the tap drafter reads); ``out_tap`` the stream after
    each layer (what a DSpark drafter reads)."""
    if block_size is None:
        return _plain_layers(state, layers, eps, table, tap, out_tap)
    partial: torch.Tensor | None = state.running
    delta, blocks = state.delta, state.blocks
    for layer in layers:
        num_blocks = math.ceil(layer.index / block_size)
        write = layer.index % block_size == 0
        x, p = ops.attn_res_step(partial, delta, blocks, num_blocks, write_block=write,
                                 proj_weight=layer.attn_site.proj, norm_weight=layer.attn_site.norm,
                                 rms_weight=layer.input_norm, eps=eps, backend=table)
        partial = None if write else p
        if tap is not None:
            tap(layer.index, x)
        a = layer.attn_forward(x)
        x, partial = ops.attn_res_step(partial, a, blocks, num_blocks + int(write), write_block=False,
                                       proj_weight=layer.mlp_site.proj, norm_weight=layer.mlp_site.norm,
                                       rms_weight=layer.post_norm, eps=eps, backend=table)
        delta = layer.mlp_forward(x)
        if out_tap is not None:
            out_tap(layer.index, partial, delta)
    return StackState(partial, delta, blocks)


def finish(state: StackState, output_site: AttnResSite | None, final_norm: torch.Tensor, eps: float,
           table) -> torch.Tensor:
    """The final-normed hidden states ``[T, hidden]`` after the last layer."""
    if state.blocks is None:
        h, _ = ops.add_rms_norm(state.delta, state.running, final_norm, eps, backend=table)
        return h
    h, _ = ops.attn_res_step(state.running, state.delta, state.blocks, state.blocks.shape[0], write_block=False,
                             proj_weight=output_site.proj, norm_weight=output_site.norm, rms_weight=final_norm,
                             eps=eps, backend=table)
    return h


def _plain_layers(state: StackState, layers: Sequence[StackLayer], eps: float, table, tap: Tap | None,
                  out_tap: OutTap | None) -> StackState:
    residual, delta = state.running, state.delta
    for layer in layers:
        if delta is None:  # layer 0: nothing to add yet
            x = ops.rms_norm(residual, layer.input_norm, eps, backend=table)
        else:
            x, residual = ops.add_rms_norm(delta, residual, layer.input_norm, eps, backend=table)
        if tap is not None:
            tap(layer.index, x)
        a = layer.attn_forward(x)
        x, residual = ops.add_rms_norm(a, residual, layer.post_norm, eps, backend=table)
        delta = layer.mlp_forward(x)
        if out_tap is not None:
            out_tap(layer.index, residual, delta)
    return StackState(residual, delta)
