"""CacheGeometry: the hybrid cache's shape, planned once from the cache config and the model, read by everyone.

The engine plans it (:func:`rocm_k3.engine.core.plan_cache`, from :class:`~rocm_k3.cache.config.CacheConfig`, the
engine args and the worker's bytes per token / per slot), builds the scheduler and cache manager from it and sends
it to every worker with ``init_cache`` (the step contract), which allocates its pools and block tables from it.
No consumer recomputes a block size, a table width or a pool size of its own.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class CacheGeometry:
    """The planned cache (integers only).

    block_size / match_unit / alignment / kda_save_grid: the granularities (see :mod:`rocm_k3.cache.config`).
    num_blocks:      KV blocks (MLA pages) of every pool; ids ``0 .. num_blocks - 1``.
    num_slots:       KDA state slots; ids ``0 .. num_slots - 1``.
    max_model_len:   prompt + generated tokens of one request.
    bytes_per_block: one page of every MLA layer of one rank; bytes_per_slot: one slot of every KDA layer of one
                     rank (recurrent fp32 state + conv state).
    enable_prefix_caching: whether saved prefixes are matched (a request then pins one source block and slot).
    """

    block_size: int
    match_unit: int
    alignment: int
    kda_save_grid: int
    num_blocks: int
    num_slots: int
    max_model_len: int
    bytes_per_block: int
    bytes_per_slot: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "enable_prefix_caching":
                if not isinstance(value, bool):
                    raise TypeError(f"CacheGeometry.enable_prefix_caching: expected bool, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CacheGeometry.{field.name}: expected a positive int, got {value!r}")

    @property
    def table_width(self) -> int:
        """Columns of a worker's block table: the blocks of ``max_model_len`` positions plus one spare column."""
        return -(-self.max_model_len // self.block_size) + 1

    @property
    def kv_bytes(self) -> int:
        """The KV pools of one rank (without the scratch block)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def state_bytes(self) -> int:
        """The KDA state pools of one rank (without the scratch slot)."""
        return self.num_slots * self.bytes_per_slot
