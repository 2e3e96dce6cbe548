"""Whole-cache consistency check, run by tests after every engine step (and available for debugging).

Checked: every reference count equals the live references (block tables, running slots, pending saves, pinned
copy sources); every id is in exactly one of free / evictable / in use; the ``cached`` marks agree with the prefix
index; no block is leaked or owned twice where it may be written; no saved (shared) state is a running slot or a
copy destination, i.e. a shared state is never written in place.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from rocm_k3.cache.block_pool import BlockPool
from rocm_k3.cache.manager import CacheManager


class CacheInvariantError(RuntimeError):
    """The cache bookkeeping is inconsistent; the message lists every violation found."""


def check_invariants(
    manager: CacheManager, computed_tokens: Mapping[int, int] | None = None, *, between_steps: bool = False
) -> None:
    """Raise :class:`CacheInvariantError` listing all violations.

    computed_tokens: seq_id -> tokens whose KV is already in the sequence's blocks (cached or computed). With it,
    the blocks a sequence will write next (from block ``computed // block_size`` on) must be in no other table.
    between_steps: no step is in flight, so no copy may be pending and no save slot outstanding (a leak otherwise).
    """
    problems: list[str] = []
    unfinished = manager.unfinished_copies()
    if between_steps:
        if any(plan for plan in unfinished):
            problems.append(f"copies still pinned between steps: {[p for p in unfinished if p]}")
        if manager.pending_saves():
            problems.append(f"save slots still outstanding between steps: {sorted(manager.pending_saves())}")
    pinned_blocks = collections.Counter(src for plan in unfinished for src, _, _ in plan.block_copies)
    pinned_slots = collections.Counter(src for plan in unfinished for src, _ in plan.state_copies)

    # ---- blocks ----
    holders: dict[int, list[int]] = collections.defaultdict(list)
    for seq_id, seq in manager.seqs.items():
        if len(set(seq.block_table)) != len(seq.block_table):
            problems.append(f"seq {seq_id}: block table {seq.block_table} repeats a block")
        for block in seq.block_table:
            holders[block].append(seq_id)
    expected = {b: len(holders.get(b, ())) + pinned_blocks.get(b, 0) for b in range(manager.blocks.size)}
    problems += _check_pool(manager.blocks, expected, manager.index.cached_blocks())
    if computed_tokens is not None:
        for seq_id, seq in manager.seqs.items():
            done = computed_tokens.get(seq_id)
            if done is None:
                problems.append(f"seq {seq_id}: holds cache but is not a live sequence")
                continue
            for block in seq.block_table[done // manager.block_size :]:
                if len(holders[block]) != 1:
                    problems.append(f"seq {seq_id}: block {block} it writes next is also held by {holders[block]}")
    for plan in unfinished:
        for src, dst, n in plan.block_copies:
            if src == dst or not 0 < n < manager.block_size:
                problems.append(f"bad block copy {src}->{dst} of {n} tokens")
            if len(holders.get(dst, ())) != 1:
                problems.append(f"copy destination block {dst} is held by {holders.get(dst)}")

    # ---- KDA slots ----
    running = {seq.slot: seq_id for seq_id, seq in manager.seqs.items()}
    if len(running) != len(manager.seqs):
        problems.append("two sequences share a running KDA slot")
    if running != manager.slots.running_slots():
        problems.append(f"running slot owners {manager.slots.running_slots()} != sequences' slots {running}")
    saved = manager.index.saved_states()
    pending = manager.pending_saves()
    for slot in running.keys() & (saved.keys() | pending):
        problems.append(f"running slot {slot} is also a saved or pending-save state")
    for slot in pending & saved.keys():
        problems.append(f"pending save slot {slot} is already a saved state")
    for plan in unfinished:
        for src, dst in plan.state_copies:
            if src not in saved and manager.slots.pool.is_cached(src):
                problems.append(f"state copy source {src} is cached but not in the index")
            if dst not in running or dst in saved:
                problems.append(f"state copy destination {dst} is not a private running slot")
    expected = {s: (s in running) + (s in pending) + pinned_slots.get(s, 0) for s in range(manager.slots.size)}
    problems += _check_pool(manager.slots.pool, expected, set(saved))

    # ---- index structure ----
    for node in manager.index.nodes():
        parent = node.parent
        if not node.alive or parent is None or parent.children.get(node.tokens) is not node:
            problems.append(f"index node at depth {node.depth} is detached but reachable")
        elif node.depth != parent.depth + 1 or len(node.tokens) != manager.match_unit:
            problems.append(f"index node at depth {node.depth} has a bad depth or unit length")
        if not manager.blocks.is_cached(node.block):
            problems.append(f"index node at depth {node.depth} points at uncached block {node.block}")
        if node.state is not None and saved.get(node.state) is not node:
            problems.append(f"index node at depth {node.depth} has unregistered state slot {node.state}")
    if problems:
        raise CacheInvariantError("cache invariants violated:\n  " + "\n  ".join(problems))


def _check_pool(pool: BlockPool, expected_refs: dict[int, int], cached: set[int]) -> list[str]:
    problems = []
    free = pool.free_ids()
    evictable = pool.evictable_ids()
    if len(set(free)) != len(free):
        problems.append(f"{pool.kind} free list has duplicates")
    free_set, evict_set = set(free), set(evictable)
    for i in range(pool.size):
        ref = pool.refcount(i)
        if ref != expected_refs[i]:
            problems.append(f"{pool.kind} {i}: refcount {ref} != {expected_refs[i]} live references")
        if pool.is_cached(i) != (i in cached):
            problems.append(f"{pool.kind} {i}: cached mark {pool.is_cached(i)} disagrees with the index")
        states = (i in free_set) + (i in evict_set) + (ref > 0)
        if states != 1:
            problems.append(f"{pool.kind} {i}: in {states} of free/evictable/in-use (leaked or double-owned)")
        if i in free_set and pool.is_cached(i):
            problems.append(f"{pool.kind} {i}: free but cached")
        if i in evict_set and not pool.is_cached(i):
            problems.append(f"{pool.kind} {i}: evictable but not cached")
    return problems
