"""MLA under vLLM: expanded-head attention through vLLM's standard ``Attention`` layer.

vLLM's MLA backends cache the 576-wide latent, but on the CPU (and wherever a backend cannot take the block size
the hybrid KDA page forces) they cannot run this model. The expanded form is exact: per head the key is
``k_nope | k_pe`` (the shared rope part broadcast to every head) and the value ``v`` (from ``kv_b`` of the
normalised latent), zero-padded to the same width; queries keep ``q_nope | q_pe`` (NoPE: never rotated).
Zero-padding the value adds zero output columns, which are dropped; padding q and k (when the head size is
rounded up to a size every backend takes) adds zero to every dot product. The scale stays ``q_head_dim ** -0.5``.
The cost: ``Hl * 2 * head_size`` cached values per token instead of 576.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from rocm_k3.integrations.vllm.arch import expanded_head_size
from rocm_k3.model.mla import MLALayer


def describe_mla_path(head_size: int, heads: int) -> str:
    """Why the expanded-head path serves MLA here (logged once per model)."""
    from vllm.platforms import current_platform

    where = "the CPU" if current_platform.is_cpu() else current_platform.device_name
    return (f"MLA runs as expanded-head attention through vLLM's standard Attention on {where}: {heads} heads of "
            f"{head_size} values (values zero-padded), block size chosen by vLLM for the hybrid KDA page; vLLM's "
            f"latent MLA backends are not used by this plugin")


class ExpandedMLA(nn.Module):
    """``forward(x [T, hidden], *_) -> [T, hidden]``: rocm-k3's MLA sublayer (its projections and output gate)
    with the attention itself in vLLM's paged ``Attention`` (registered as ``prefix + ".attn"``)."""

    def __init__(self, mla: MLALayer, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        cfg = mla.cfg
        self.mla, self.cfg = mla, cfg
        self.head_size = expanded_head_size(cfg.q_head_dim, cfg.v_head_dim)
        if vllm_config.model_config.get_head_size() != self.head_size:
            raise ValueError(f"vLLM sizes attention heads as {vllm_config.model_config.get_head_size()}, the "
                             f"plugin's expanded MLA needs {self.head_size}: the rocm-k3 config view is not "
                             f"registered for this model (is the rocm_k3 vLLM plugin loaded?)")
        self.attn = Attention(num_heads=mla.heads, head_size=self.head_size, scale=mla.scale,
                              num_kv_heads=mla.heads, cache_config=vllm_config.cache_config, prefix=prefix + ".attn")

    def forward(self, x: torch.Tensor, *_unused) -> torch.Tensor:
        cfg, mla, hs = self.cfg, self.mla, self.head_size
        t, h = x.shape[0], mla.heads
        q, c_kv, k_pe, gate = mla.project(x)  # [T, Hl, Dn + P], [T, R], [T, P], [T, Hl Dv]
        kv = mla.kv_b(c_kv).view(t, h, cfg.qk_nope_head_dim + cfg.v_head_dim)  # [T, Hl, Dn + Dv]
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(t, h, cfg.qk_rope_head_dim)], dim=-1)  # [T, Hl, Dn + P]
        q, k = (F.pad(a, (0, hs - cfg.q_head_dim)) for a in (q, k))  # [T, Hl, hs]
        v = F.pad(v, (0, hs - cfg.v_head_dim))  # [T, Hl, hs]
        out = self.attn(q.reshape(t, h * hs), k.reshape(t, h * hs), v.reshape(t, h * hs))  # [T, Hl hs]
        return mla.output(out.view(t, h, hs)[..., : cfg.v_head_dim], gate)


