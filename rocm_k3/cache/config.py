"""Cache configuration: the three token granularities of the hybrid prefix cache, and the memory budgets.

- ``block_size`` (**physical block size**): tokens per MLA latent page, the allocation unit of the KV cache.
- ``match_unit`` (**prefix match unit**): prefixes are hashed and matched every ``match_unit`` tokens. It divides
  ``block_size``, so a match can end in the middle of a block (that block is then copied, see below), and it is
  a multiple of ``kda_save_grid``.
- ``alignment`` (**scheduler alignment**): every prefill chunk except a prefill's last one ends on a multiple of
  ``alignment``, and a KDA state is saved at every multiple of ``alignment`` a prefill passes. It is a multiple
  of ``match_unit``, so chunks start on match-unit boundaries.
- ``kda_save_grid``: the granularity, relative to a chunk start, at which KDA prefill kernels can emit
  intermediate states (64, the chunk size of the chunked KDA algorithm, for the GPU kernels; the reference
  backend saves anywhere, so tests may lower it). Because chunks start on match-unit boundaries and the match
  unit is a multiple of this grid, every save point below is a legal kernel save position.

Where KDA states are saved (each one a prefix-cache entry, LRU-evicted under ``state_cache_bytes``):
(1) at every multiple of ``alignment`` that a prefill passes, and (2) at the last match-unit boundary of each
prefill (``floor(len / match_unit) * match_unit``), which is where a later request extending the same
conversation resumes. In K3 one KDA state (~434 MB) outweighs ~15,000 tokens of MLA KV, hence not at every unit.

Usable match rule: a request reuses the longest prefix ``L`` that (a) is a whole number of match units whose
hashes are all in the index, (b) has a saved KDA state at ``L``, and (c) leaves at least one prompt token to
compute (the logits of the last prompt token are needed). Blocks entirely below ``L`` are shared; a block that
``L`` ends inside is copied into a private block, and the saved state is always copied into the request's private
running slot, so a cache entry is never written in place.
"""

from __future__ import annotations

import dataclasses

from rocm_k3.cache.errors import AlignmentError, CacheBudgetError, MatchUnitError
from rocm_k3.cache.geometry import CacheGeometry

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """Validated cache knobs (see the module docstring for the three granularities).

    kv_cache_bytes / state_cache_bytes: memory budgets for the MLA pages (all MLA layers) and the KDA state slots
    (all KDA layers: recurrent fp32 + conv state). ``num_blocks`` / ``num_state_slots`` override them with exact
    counts (tests, or a caller that sized memory itself).
    """

    block_size: int = 128
    match_unit: int = 64
    alignment: int = 256
    kda_save_grid: int = 64
    enable_prefix_caching: bool = True
    kv_cache_bytes: int = 256 * _MiB
    state_cache_bytes: int = 256 * _MiB
    num_blocks: int | None = None
    num_state_slots: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "match_unit", "alignment", "kda_save_grid", "kv_cache_bytes", "state_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CacheConfig.{name}: expected a positive int, got {value!r}")
        for name in ("num_blocks", "num_state_slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"CacheConfig.{name}: expected a positive int or None, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"CacheConfig.enable_prefix_caching: expected bool, got {self.enable_prefix_caching!r}")
        if self.block_size % self.match_unit:
            raise MatchUnitError(
                f"match_unit={self.match_unit} must divide block_size={self.block_size} "
                "(a block holds a whole number of match units)"
            )
        if self.match_unit % self.kda_save_grid:
            raise MatchUnitError(
                f"match_unit={self.match_unit} must be a multiple of kda_save_grid={self.kda_save_grid} "
                "(KDA states are saved at every match-unit boundary, and kernels save on that grid only)"
            )
        if self.alignment % self.match_unit:
            raise AlignmentError(
                f"alignment={self.alignment} must be a multiple of match_unit={self.match_unit} "
                "(prefill chunks must start on a match-unit boundary)"
            )

    def blocks_per_request(self, max_model_len: int) -> int:
        """KV blocks one request of ``max_model_len`` tokens needs, plus one when prefix caching is on (the
        source block of a pending copy-on-write is pinned next to the request's own blocks)."""
        return -(-max_model_len // self.block_size) + (1 if self.enable_prefix_caching else 0)

    def slots_per_request(self) -> int:
        """KDA slots one request needs: its running slot, plus a pinned saved state to copy from when caching."""
        return 2 if self.enable_prefix_caching else 1

    def max_len_for(self, num_blocks: int) -> int:
        """The longest request ``num_blocks`` blocks can hold (inverse of :meth:`blocks_per_request`)."""
        return max(0, num_blocks - (1 if self.enable_prefix_caching else 0)) * self.block_size

    def counts(self, *, bytes_per_block: int, bytes_per_slot: int) -> tuple[int, int]:
        """(num_blocks, num_state_slots) the budgets (or the explicit counts) give, without a fit check."""
        num_blocks = self.num_blocks if self.num_blocks is not None else self.kv_cache_bytes // bytes_per_block
        num_slots = (
            self.num_state_slots if self.num_state_slots is not None else self.state_cache_bytes // bytes_per_slot
        )
        return num_blocks, num_slots

    def geometry(self, *, num_blocks: int, num_slots: int, max_model_len: int, bytes_per_block: int = 1,
                 bytes_per_slot: int = 1) -> CacheGeometry:
        """The :class:`CacheGeometry` of these granularities with the given pool sizes (see :meth:`resolve`)."""
        return CacheGeometry(block_size=self.block_size, match_unit=self.match_unit, alignment=self.alignment,
                             kda_save_grid=self.kda_save_grid, num_blocks=num_blocks, num_slots=num_slots,
                             max_model_len=max_model_len, bytes_per_block=bytes_per_block,
                             bytes_per_slot=bytes_per_slot, enable_prefix_caching=self.enable_prefix_caching)

    def bytes_per_block(self, bytes_per_token: int) -> int:
        """One page of every MLA layer of a rank that caches ``bytes_per_token`` per token (at least 1)."""
        return max(1, bytes_per_token * self.block_size)

    def plan(self, *, bytes_per_token: int, bytes_per_slot: int, max_model_len: int) -> CacheGeometry:
        """The geometry of these knobs on a rank caching ``bytes_per_token`` per MLA token and ``bytes_per_slot``
        per KDA slot (pool sizes from :meth:`resolve`; raises CacheBudgetError when one request cannot fit)."""
        per_block = self.bytes_per_block(bytes_per_token)
        num_blocks, num_slots = self.resolve(bytes_per_block=per_block, bytes_per_slot=bytes_per_slot,
                                             max_model_len=max_model_len)
        return self.geometry(num_blocks=num_blocks, num_slots=num_slots, max_model_len=max_model_len,
                             bytes_per_block=per_block, bytes_per_slot=bytes_per_slot)

    def resolve(self, *, bytes_per_block: int, bytes_per_slot: int, max_model_len: int) -> tuple[int, int]:
        """(num_blocks, num_state_slots) from the byte budgets (or the explicit counts).

        bytes_per_block: one page of all MLA layers (num_mla_layers * block_size * latent width * itemsize);
        bytes_per_slot: one slot of all KDA layers (recurrent fp32 [H, K, V] + conv [3*H*K, W-1] per layer).
        Raises CacheBudgetError when one request of ``max_model_len`` tokens could not fit.
        """
        for name, value in (
            ("bytes_per_block", bytes_per_block),
            ("bytes_per_slot", bytes_per_slot),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        num_blocks, num_slots = self.counts(bytes_per_block=bytes_per_block, bytes_per_slot=bytes_per_slot)
        need_blocks = self.blocks_per_request(max_model_len)
        if num_blocks < need_blocks:
            raise CacheBudgetError(
                f"KV budget holds {num_blocks} blocks of {self.block_size} tokens "
                f"({bytes_per_block} bytes each, kv_cache_bytes={self.kv_cache_bytes}, num_blocks={self.num_blocks}); "
                f"one request of max_model_len={max_model_len} needs {need_blocks}"
            )
        need_slots = self.slots_per_request()
        if num_slots < need_slots:
            raise CacheBudgetError(
                f"KDA state budget holds {num_slots} slots ({bytes_per_slot} bytes each, "
                f"state_cache_bytes={self.state_cache_bytes}, num_state_slots={self.num_state_slots}); "
                f"one request needs {need_slots}"
            )
        return num_blocks, num_slots
