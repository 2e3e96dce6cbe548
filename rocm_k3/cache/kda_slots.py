"""KDA state slots (one recurrent fp32 state + one conv state per KDA layer each), as integer ids.

A slot is in one of these roles (the tensors live in :class:`rocm_k3.worker.kv_pools.KVPools`):

- **running**: the private, in-place-updated state of one running sequence (refcount 1, owner recorded);
- **pending save**: allocated for a ``save_positions`` row of the current step; private until the step ran;
- **saved**: a published prefix-cache entry (the state after an aligned prefix). Never written again; it is read
  only by copying it into a running slot (copy-on-write), pinned (refcount > 0) while such a copy is pending,
  otherwise evictable in LRU order;
- **free**.
"""

from __future__ import annotations

from collections.abc import Callable

from rocm_k3.cache.block_pool import BlockPool


class KDASlotPool:
    """State-slot bookkeeping over :class:`BlockPool` plus the owner of each running slot."""

    def __init__(self, size: int, on_evict: Callable[[int], None] | None = None) -> None:
        self.pool = BlockPool(size, kind="KDA state slot", on_evict=on_evict)
        self._owner: dict[int, int] = {}  # running slot -> sequence id

    @property
    def size(self) -> int:
        return self.pool.size

    def owner(self, slot: int) -> int | None:
        """The sequence whose running state is in ``slot``, or None."""
        return self._owner.get(slot)

    def running_slots(self) -> dict[int, int]:
        return dict(self._owner)

    def allocate_running(self, seq_id: int) -> int | None:
        """A private slot for a sequence's running state (may evict the least recently used saved state)."""
        slot = self.pool.allocate()
        if slot is not None:
            self._owner[slot] = seq_id
        return slot

    def release_running(self, slot: int) -> None:
        if slot not in self._owner:
            raise RuntimeError(f"KDA slot {slot} is not a running slot")
        del self._owner[slot]
        self.pool.decref(slot)

    def allocate_save(self) -> int | None:
        """A private slot that the model fills with a saved state this step (None when all slots are busy)."""
        return self.pool.allocate()

    def adopt_running(self, slot: int, seq_id: int) -> None:
        """A private save slot becomes ``seq_id``'s running slot (speculative rollback picks a per-position state)."""
        if slot in self._owner:
            raise RuntimeError(f"KDA slot {slot} is already a running slot")
        self._owner[slot] = seq_id

    def publish(self, slot: int) -> None:
        """The saved state in ``slot`` becomes a cache entry (read-only, evictable when unpinned)."""
        if slot in self._owner:
            raise RuntimeError(f"KDA slot {slot} is a running slot and cannot be published")
        self.pool.mark_cached(slot)
        self.pool.decref(slot)

    def discard(self, slot: int) -> None:
        """Give back a save slot that was not published."""
        self.pool.decref(slot)

    def pin(self, slot: int) -> None:
        """Keep a saved state alive while a copy out of it is pending."""
        if not self.pool.is_cached(slot):
            raise RuntimeError(f"KDA slot {slot} is not a saved state")
        self.pool.incref(slot)

    def unpin(self, slot: int) -> None:
        self.pool.decref(slot)
