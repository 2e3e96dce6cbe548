"""The hybrid cache's tensors (worker side): paged MLA latent KV per MLA layer, KDA state/conv slots per KDA layer.

Implements :class:`rocm_k3.model.forward_batch.HybridCacheView`. Block ids and slot ids are shared by all
layers: block ``b`` is page ``b`` of every MLA layer's pool and slot ``s`` is entry ``s`` of every KDA layer's
state and conv pools, so the integer bookkeeping of :class:`rocm_k3.cache.manager.CacheManager` (which hands out
ids ``0 .. num_blocks - 1`` and ``0 .. num_slots - 1``) applies to all layers at once. One extra block and one
extra slot past those ids are scratch space for the padded rows of a captured decode graph
(:attr:`KVPools.pad_block`, :attr:`KVPools.pad_slot`). Memory is allocated once, up front;
:meth:`KVPools.apply_copies` executes a copy-on-write plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rocm_k3.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PoolShapes:
    """Per-layer cache tensor shapes of one rank (the pools' sizes come from the planned
    :class:`~rocm_k3.cache.geometry.CacheGeometry`).

    num_mla_layers / num_kda_layers: layers of each kind; kda_heads (H), kda_head_dim (K = V), conv_width (W);
    mla_latent_width: values cached per token per MLA layer (kv_lora_rank + qk_rope_head_dim; 576 for K3);
    dtype: MLA latent and conv state dtype (the model's activation dtype); the KDA recurrent state is fp32.
    """

    num_mla_layers: int
    num_kda_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_width: int
    dtype: torch.dtype
    mla_latent_width: int = 576

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, dtype: torch.dtype) -> PoolShapes:
        return cls(
            len(cfg.mla_layers),
            len(cfg.kda_layers),
            cfg.kda.num_heads,
            cfg.kda.head_dim,
            cfg.kda.conv_kernel_size,
            dtype,
            cfg.mla_latent_width,
        )

    @classmethod
    def from_model(cls, model, dtype: torch.dtype) -> PoolShapes:
        """The pools of one rank: its stage's layers and its share of the KDA heads."""
        cfg = model.cfg
        return cls(model.num_mla_layers, model.num_kda_layers, cfg.kda.num_heads // model.ctx.tp_size,
                   cfg.kda.head_dim, cfg.kda.conv_kernel_size, dtype, cfg.mla_latent_width)

    @property
    def conv_channels(self) -> int:
        return 3 * self.kda_heads * self.kda_head_dim  # q | k | v

    def bytes_per_token(self) -> int:
        """One token of every MLA layer: num_mla_layers * latent width * itemsize (0 on a stage without MLA)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_mla_layers * self.mla_latent_width * itemsize

    def bytes_per_block(self, block_size: int) -> int:
        """One page of every MLA layer: bytes_per_token * block_size (at least 1)."""
        return max(1, self.bytes_per_token() * block_size)

    def bytes_per_slot(self) -> int:
        """One slot of every KDA layer: fp32 [H, K, V] state + [3*H*K, W-1] conv state (at least 1)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        h, d = self.kda_heads, self.kda_head_dim
        per_layer = h * d * d * 4 + self.conv_channels * (self.conv_width - 1) * itemsize
        return max(1, self.num_kda_layers * per_layer)


def mla_layer_name(i: int) -> str:
    """The KV connector's name of the i-th MLA layer's pages."""
    return f"mla.{i}"


def kda_layer_names(i: int) -> tuple[str, str]:
    """The KV connector's names of the i-th KDA layer's (recurrent, conv) state pools."""
    return f"kda.{i}.recurrent", f"kda.{i}.conv"


class KVPools:
    """Tensor pools behind the cache manager's ids (a :class:`HybridCacheView`), plus one scratch block and slot."""

    def __init__(
        self,
        shapes: PoolShapes,
        *,
        block_size: int,
        num_blocks: int,
        num_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.shapes = shapes
        self._block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.device = torch.device(device)
        g = shapes
        nb, ns = num_blocks + 1, num_slots + 1  # + the scratch block / slot of padded graph rows
        self._mla = [
            torch.zeros(nb, block_size, g.mla_latent_width, dtype=g.dtype, device=self.device)
            for _ in range(g.num_mla_layers)
        ]  # [num_blocks + 1, block_size, latent] each
        self._kda = [
            torch.zeros(ns, g.kda_heads, g.kda_head_dim, g.kda_head_dim, dtype=torch.float32, device=self.device)
            for _ in range(g.num_kda_layers)
        ]  # [S + 1, H, K, V] each
        self._conv = [
            torch.zeros(ns, g.conv_channels, g.conv_width - 1, dtype=g.dtype, device=self.device)
            for _ in range(g.num_kda_layers)
        ]  # [S + 1, 3*H*K, W-1] each

    @property
    def pad_block(self) -> int:
        """A block no request owns: padded rows of a captured decode graph read and write it."""
        return self.num_blocks

    @property
    def pad_slot(self) -> int:
        """A KDA slot no request owns, for padded graph rows."""
        return self.num_slots

    # ---- HybridCacheView -----------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block_size

    def mla_kv(self, mla_layer_idx: int) -> torch.Tensor:
        return self._mla[mla_layer_idx]

    def kda_state(self, kda_layer_idx: int) -> torch.Tensor:
        return self._kda[kda_layer_idx]

    def conv_state(self, kda_layer_idx: int) -> torch.Tensor:
        return self._conv[kda_layer_idx]

    def transfer_groups(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The pools by name for a KV connector: MLA pages ``mla.<i>`` ([num_blocks + 1, block_size, latent]) and
        per KDA layer ``kda.<i>.recurrent`` / ``kda.<i>.conv`` ([num_slots + 1, ...])."""
        mla = {mla_layer_name(i): t for i, t in enumerate(self._mla)}
        kda = {}
        for i, (rec, conv) in enumerate(zip(self._kda, self._conv)):
            (rec_name, conv_name) = kda_layer_names(i)
            kda[rec_name], kda[conv_name] = rec, conv
        return mla, kda

    # ---- copy-on-write -------------------------------------------------------------------------------------
    def apply_copies(self, block_copies: Sequence[tuple[int, int, int]],
                     state_copies: Sequence[tuple[int, int]]) -> None:
        """Copy the first n latent rows of each (src, dst, n) block in every MLA layer, and the recurrent and
        conv state of each (src, dst) slot in every KDA layer. Sources are never written."""
        for src, dst, n in block_copies:
            if src == dst:
                raise ValueError(f"block copy {src} -> {dst}: source and destination must differ")
            for pages in self._mla:
                pages[dst, :n].copy_(pages[src, :n])
        if state_copies:
            src = torch.tensor([s for s, _ in state_copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([d for _, d in state_copies], dtype=torch.long, device=self.device)
            for pool in (*self._kda, *self._conv):
                pool[dst] = pool[src]
