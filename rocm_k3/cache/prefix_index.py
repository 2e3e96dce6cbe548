"""The prefix index: a hash chain over match units, pointing at KV blocks and at saved KDA states.

Each node stands for one match unit of some token sequence: its key is (parent node, the unit's tokens), so the
path from the root spells a prefix whose length is ``depth * match_unit``. A node records

- ``block``: the physical KV block that holds this unit (at offset ``(depth - 1) * match_unit % block_size``). That
  block also holds every earlier unit of the same block range of this path (it was written by a sequence with
  exactly this prefix, or copied from one), so the *last* matched node of a block range names a block usable for
  the whole range;
- ``state``: a saved KDA state slot holding the recurrent + conv state after ``depth * match_unit`` tokens, or None.

Keys are exact (tuples of token ids in a dict), so there are no false hits from hash collisions.

Eviction is driven by the pools: when a block is reclaimed the nodes that point at it and their whole subtrees are
dropped (descendants are unreachable without them), releasing the blocks and states those nodes referred to.
When a state slot is reclaimed only the node's ``state`` is cleared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from rocm_k3.cache.block_pool import BlockPool
from rocm_k3.cache.kda_slots import KDASlotPool


@dataclasses.dataclass(eq=False)
class PrefixNode:
    depth: int  # match units from the root
    tokens: tuple[int, ...]  # this unit's token ids
    parent: PrefixNode | None
    block: int  # KV block holding this unit (-1 for the root)
    state: int | None = None  # saved KDA state slot after this unit
    alive: bool = True  # False once dropped from the index
    children: dict[tuple[int, ...], PrefixNode] = dataclasses.field(default_factory=dict)


class PrefixIndex:
    """Match-unit trie over token ids; the owner of the ``cached`` marks of the block and slot pools."""

    def __init__(self, match_unit: int, block_size: int, blocks: BlockPool, slots: KDASlotPool) -> None:
        if match_unit < 1 or block_size % match_unit:
            raise ValueError(f"match_unit={match_unit} must be positive and divide block_size={block_size}")
        self.match_unit = match_unit
        self.block_size = block_size
        self.blocks = blocks
        self.slots = slots
        self.root = PrefixNode(depth=0, tokens=(), parent=None, block=-1)
        self._by_block: dict[int, set[PrefixNode]] = {}
        self._by_state: dict[int, PrefixNode] = {}

    # ---- lookup --------------------------------------------------------------------------------------------
    def walk(self, token_ids: Sequence[int], max_units: int | None = None) -> list[PrefixNode]:
        """Nodes matching the successive full units of ``token_ids`` (at most ``max_units``), root excluded."""
        u = self.match_unit
        limit = len(token_ids) // u if max_units is None else min(max_units, len(token_ids) // u)
        path: list[PrefixNode] = []
        node = self.root
        for k in range(limit):
            child = node.children.get(tuple(token_ids[k * u : (k + 1) * u]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def longest_state_match(self, token_ids: Sequence[int], max_units: int, every: int = 1) -> list[PrefixNode]:
        """The matched path cut at its deepest node that has a saved state and a depth that is a multiple of
        ``every`` units (empty when there is none)."""
        path = self.walk(token_ids, max_units)
        for end in range(len(path) // every * every, 0, -every):
            if path[end - 1].state is not None:
                return path[:end]
        return []

    # ---- insertion -----------------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], num_units: int, block_table: Sequence[int]) -> list[PrefixNode]:
        """Make sure the first ``num_units`` units of ``token_ids`` are indexed; a missing node points at the
        sequence's own block ``block_table[unit start // block_size]`` (whose KV for that unit is computed).
        Existing nodes are kept (the first writer wins). Returns the path."""
        u, b = self.match_unit, self.block_size
        if num_units * u > len(token_ids):
            raise ValueError(f"num_units={num_units} exceeds the {len(token_ids)} tokens given")
        node = self.root
        path: list[PrefixNode] = []
        for k in range(num_units):
            key = tuple(token_ids[k * u : (k + 1) * u])
            child = node.children.get(key)
            if child is None:
                block = block_table[(k * u) // b]
                child = PrefixNode(depth=k + 1, tokens=key, parent=node, block=block)
                node.children[key] = child
                self._by_block.setdefault(block, set()).add(child)
                self.blocks.mark_cached(block)
            path.append(child)
            node = child
        return path

    def attach_state(self, node: PrefixNode, slot: int) -> bool:
        """Publish ``slot`` as the saved state of ``node``; False (slot untouched) if it already has one."""
        if node.state is not None or node.depth == 0:
            return False
        node.state = slot
        self._by_state[slot] = node
        self.slots.publish(slot)
        return True

    # ---- eviction (pool callbacks) -------------------------------------------------------------------------
    def on_block_evicted(self, block: int) -> None:
        for node in list(self._by_block.get(block, ())):
            if node.alive:  # may already be gone with an ancestor's subtree
                self._remove_subtree(node)

    def on_state_evicted(self, slot: int) -> None:
        node = self._by_state.pop(slot, None)
        if node is not None:
            node.state = None

    def _remove_subtree(self, top: PrefixNode) -> None:
        if top.parent is not None:
            del top.parent.children[top.tokens]
        stack = [top]
        while stack:
            node = stack.pop()
            node.alive = False
            stack.extend(node.children.values())
            owners = self._by_block.get(node.block)
            if owners is not None:
                owners.discard(node)
                if not owners:
                    del self._by_block[node.block]
                    self.blocks.uncache(node.block)
            if node.state is not None:
                del self._by_state[node.state]
                self.slots.pool.uncache(node.state)
                node.state = None

    # ---- introspection (invariant checks, stats) -----------------------------------------------------------
    def nodes(self) -> Iterator[PrefixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_blocks(self) -> set[int]:
        return set(self._by_block)

    def saved_states(self) -> dict[int, PrefixNode]:
        return dict(self._by_state)
