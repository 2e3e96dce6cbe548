"""A step's view of the KV pools that runs a hook the first time the forward takes each layer's pool: the KV
connector's per-layer save (producer: publish the layer before it is updated) and load (consumer: copy the layer in
before it is read), so the transfer of later layers overlaps the compute of earlier ones."""

from __future__ import annotations

from typing import Any, Callable

import torch

from rocm_k3.worker.kv_pools import KVPools, kda_layer_names, mla_layer_name


class LayerHookView:
    """``pools`` as a ``HybridCacheView``; ``on_layer(name)`` runs before a layer's pool is first handed out.
    ``order``: the layer names in the order the forward took them."""

    def __init__(self, pools: KVPools, on_layer: Callable[[str], None]) -> None:
        self.pools = pools
        self.on_layer = on_layer
        self.order: list[str] = []

    def _take(self, name: str) -> None:
        if name not in self.order:
            self.order.append(name)
            self.on_layer(name)

    @property
    def block_size(self) -> int:
        return self.pools.block_size

    def mla_kv(self, mla_layer_idx: int) -> torch.Tensor:
        self._take(mla_layer_name(mla_layer_idx))
        return self.pools.mla_kv(mla_layer_idx)

    def kda_state(self, kda_layer_idx: int) -> torch.Tensor:
        self._take(kda_layer_names(kda_layer_idx)[0])
        return self.pools.kda_state(kda_layer_idx)

    def conv_state(self, kda_layer_idx: int) -> torch.Tensor:
        self._take(kda_layer_names(kda_layer_idx)[1])
        return self.pools.conv_state(kda_layer_idx)

    def __getattr__(self, name: str) -> Any:  # everything else of the pools, unchanged
        return getattr(self.pools, name)
