"""A pool of integer ids with reference counts and an LRU of cached, unreferenced ids.

Plain Python (no tensors): the same class manages MLA KV blocks (ids = physical page numbers) and, through
:mod:`rocm_k3.cache.kda_slots`, KDA state slots. Every id is in exactly one of three states:

- **free**: refcount 0 and no cache entry refers to it; handed out first by :meth:`allocate`.
- **evictable**: refcount 0 but a prefix-cache entry refers to it (``cached``); kept in LRU order and reclaimed by
  :meth:`allocate` only when no free id is left, after the owner of the cache entries (the prefix index) has been
  told through the ``on_evict`` callback to drop every entry that refers to it.
- **in use**: refcount > 0 (held by running sequences, or pinned as the source of a pending copy).
"""

from __future__ import annotations

import collections
from collections.abc import Callable


class BlockPool:
    """Reference-counted ids ``0 .. size-1`` with a free list and an LRU of evictable cached ids.

    ``on_evict(id)`` is called when an evictable id is reclaimed; it must drop every cache entry that refers to
    the id (it may call :meth:`uncache` on this and other ids). ``kind`` names the resource in error messages.
    """

    def __init__(self, size: int, kind: str = "block", on_evict: Callable[[int], None] | None = None) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{kind} pool size: expected a positive int, got {size!r}")
        self.size = size
        self.kind = kind
        self.on_evict = on_evict
        self._ref = [0] * size
        self._cached = [False] * size
        self._free: collections.deque[int] = collections.deque(range(size))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------------------------
    def refcount(self, i: int) -> int:
        return self._ref[self._check(i)]

    def is_cached(self, i: int) -> bool:
        return self._cached[self._check(i)]

    def is_free(self, i: int) -> bool:
        return self._ref[self._check(i)] == 0 and not self._cached[i]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Ids :meth:`allocate` can hand out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def evictable_ids(self) -> list[int]:
        """Evictable ids, least recently released first."""
        return list(self._evictable)

    # ---- transitions ---------------------------------------------------------------------------------------
    def allocate(self) -> int | None:
        """An id with refcount 1 that nothing else refers to, or None when every id is in use.

        Takes a free id if there is one, else evicts the least recently released cached id.
        """
        if self._free:
            i = self._free.popleft()
        elif self._evictable:
            i, _ = self._evictable.popitem(last=False)
            self._cached[i] = False  # the callback's uncache(i) is then a no-op
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(i)  # may move other ids to the free list; this one is ours
        else:
            return None
        self._ref[i] = 1
        return i

    def incref(self, i: int) -> None:
        """Take one more reference; an evictable id leaves the LRU (a cache hit)."""
        self._check(i)
        if self._ref[i] == 0:
            if not self._cached[i]:
                raise RuntimeError(f"incref of free {self.kind} {i}")
            del self._evictable[i]
        self._ref[i] += 1

    def decref(self, i: int) -> None:
        """Drop one reference; at zero the id becomes evictable (cached) or free (not cached)."""
        self._check(i)
        if self._ref[i] <= 0:
            raise RuntimeError(f"decref of unreferenced {self.kind} {i}")
        self._ref[i] -= 1
        if self._ref[i] == 0:
            if self._cached[i]:
                self._evictable[i] = None  # most recently released at the end
            else:
                self._free.append(i)

    def mark_cached(self, i: int) -> None:
        """A cache entry now refers to ``i`` (which must be referenced by its writer)."""
        self._check(i)
        if self._ref[i] == 0:
            raise RuntimeError(f"mark_cached of unreferenced {self.kind} {i}")
        self._cached[i] = True

    def uncache(self, i: int) -> None:
        """No cache entry refers to ``i`` any more; an unreferenced id moves from the LRU to the free list."""
        self._check(i)
        if not self._cached[i]:
            return
        self._cached[i] = False
        if self._ref[i] == 0:
            del self._evictable[i]
            self._free.append(i)

    def _check(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(f"{self.kind} id {i} out of range [0, {self.size})")
        return i
