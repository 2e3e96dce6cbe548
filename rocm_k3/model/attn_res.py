"""The Attention Residuals dataflow (K3_SPEC section 5) over the decoder stack.

Per token the stack keeps a bank of block snapshots ``blocks [B_max, T, hidden]`` (b_0 = the embedding, one
snapshot at every layer l with ``l % B == 0``) and the running partial sum ``p`` of the current block. Each
sublayer input is a learned softmax mix over ``[b_0 .. b_{n-1}, p]`` followed by that sublayer's RMSNorm; the
fused op :func:`rocm_k3.ops.attn_res_step` does ``p += delta``, the optional snapshot, the mix and the norm::

    layer l:  nb = ceil(l / B)
              x, p = step(p, mlp_out_{l-1}, blocks, nb, write = l % B == 0, attn site, input_layernorm)
              if l % B == 0: p = None                       # the finished block was snapshotted
              a = Attn(x)
              x, p = step(p, a, blocks, nb + (l % B == 0), write = False, mlp site, post_attention_layernorm)
              m = MLP(x)
    final:    h, _ = step(p, m_last, blocks, B_max, write = False, output site, final norm)

The bank lives for one forward pass only; it is not part of the cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from rocm_k3 import ops


@dataclasses.dataclass
class AttnResSite:
    """The weights of one mixing site: ``proj [hidden]`` (the checkpoint's ``[1, hidden]`` row) and ``norm [hidden]``."""

    proj: torch.Tensor
    norm: torch.Tensor

    @classmethod
    def from_checkpoint(cls, proj: torch.Tensor, norm: torch.Tensor) -> AttnResSite:
        return cls(proj=proj.reshape(-1), norm=norm)


@dataclasses.dataclass
class AttnResLayer:
    """What the dataflow needs from one decoder layer."""

    attn_site: AttnResSite
    mlp_site: AttnResSite
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: Callable[[torch.Tensor], torch.Tensor]  # x [T, hidden] -> [T, hidden]
    mlp: Callable[[torch.Tensor], torch.Tensor]


def attn_res_stack(h0: torch.Tensor, layers: Sequence[AttnResLayer], block_size: int, output_site: AttnResSite,
                   final_norm: torch.Tensor, eps: float, backend: str | None) -> torch.Tensor:
    """Run the stack with Attention Residuals: ``h0 [T, hidden]`` (embeddings) -> final-normed hidden [T, hidden]."""
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size}")
    max_blocks = math.ceil(len(layers) / block_size)
    blocks = h0.new_empty(max_blocks, *h0.shape)  # [B_max, T, hidden], filled as blocks complete
    partial: torch.Tensor | None = h0
    delta: torch.Tensor | None = None
    for index, layer in enumerate(layers):
        num_blocks = math.ceil(index / block_size)
        write = index % block_size == 0
        x, p = ops.attn_res_step(partial, delta, blocks, num_blocks, write_block=write,
                                 proj_weight=layer.attn_site.proj, norm_weight=layer.attn_site.norm,
                                 rms_weight=layer.input_norm, eps=eps, backend=backend)
        partial = None if write else p
        a = layer.attn(x)
        x, partial = ops.attn_res_step(partial, a, blocks, num_blocks + int(write), write_block=False,
                                       proj_weight=layer.mlp_site.proj, norm_weight=layer.mlp_site.norm,
                                       rms_weight=layer.post_norm, eps=eps, backend=backend)
        delta = layer.mlp(x)
    h, _ = ops.attn_res_step(partial, delta, blocks, max_blocks, write_block=False, proj_weight=output_site.proj,
                             norm_weight=output_site.norm, rms_weight=final_norm, eps=eps, backend=backend)
    return h
