"""The cache manager: KV blocks, KDA slots and the prefix index for a set of sequences, over integer ids.

No tensors here: the manager decides which block ids and slot ids each sequence uses, which copies must run
before a step (copy-on-write of a partially matched block and of a saved KDA state), and which saved states a
prefill step should produce. :class:`rocm_k3.worker.kv_pools.KVPools` (worker side) holds the tensors and executes
the copies. See :mod:`rocm_k3.cache.config` for the match rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rocm_k3.cache.block_pool import BlockPool
from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.kda_slots import KDASlotPool
from rocm_k3.cache.prefix_index import PrefixIndex


@dataclasses.dataclass
class CopyPlan:
    """Copies to execute before the next forward step, in order.

    block_copies: (src block, dst block, num_tokens): copy the first num_tokens latent rows of every MLA layer.
    state_copies: (src slot, dst slot): copy the recurrent and conv state of every KDA layer.
    """

    block_copies: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.block_copies or self.state_copies)


@dataclasses.dataclass
class CacheStats:
    """Prefix-cache counters (cumulative).

    queries: prefix lookups (one per admission with caching on); query_tokens: prompt tokens looked up;
    hit_requests / hit_tokens: admissions that reused a prefix, and the prefill tokens they skipped;
    saved_states: KDA states published as cache entries; cow_copies: partially matched blocks copied into a
    private block; state_restores: saved states copied into a running slot; block_evictions / state_evictions:
    cache entries reclaimed for new allocations.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    saved_states: int = 0
    cow_copies: int = 0
    state_restores: int = 0
    block_evictions: int = 0
    state_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        return out


@dataclasses.dataclass
class SeqCache:
    """What one sequence holds: its block table (shared prefix blocks first), running KDA slot, cached length."""

    block_table: list[int]
    slot: int
    num_cached_tokens: int = 0
    num_tokens_looked_up: int = 0


class CacheManager:
    """Allocation, prefix matching, copy planning and state saving for the hybrid cache (integer ids only)."""

    def __init__(self, config: CacheConfig, num_blocks: int, num_slots: int) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected CacheConfig, got {type(config).__name__}")
        self.config = config
        self.block_size = config.block_size
        self.match_unit = config.match_unit
        self.caching = config.enable_prefix_caching
        self.blocks = BlockPool(num_blocks, kind="KV block", on_evict=self._on_block_evicted)
        self.slots = KDASlotPool(num_slots, on_evict=self._on_state_evicted)
        self.index = PrefixIndex(config.match_unit, config.block_size, self.blocks, self.slots)
        self.seqs: dict[int, SeqCache] = {}
        self.stats = CacheStats()
        self._pending = CopyPlan()
        self._pending_saves: set[int] = set()
        self._in_flight: list[CopyPlan] = []

    # ---- admission and growth ------------------------------------------------------------------------------
    def admit(self, seq_id: int, token_ids: Sequence[int], reuse: bool = True, *,
              whole_blocks: bool = False) -> int | None:
        """Give a new sequence a running KDA slot and reuse the longest usable cached prefix (none when not
        ``reuse``: a request that needs every prompt position computed).

        Returns the number of prefix tokens served from the cache (0 without a hit), or None (nothing changed)
        when no slot or block is available. A hit shares the blocks below the match, copies a partially
        matched block into a private block and the saved state into the running slot (planned; see
        :meth:`take_copies`). ``whole_blocks``: only a match ending on a block boundary (no copy-on-write,
        whose source block stays pinned for a step: one block more than the sequence holds).
        """
        if seq_id in self.seqs:
            raise ValueError(f"seq_id {seq_id} is already admitted")
        if len(token_ids) < 1:
            raise ValueError("token_ids: expected at least one token")
        slot = self.slots.allocate_running(seq_id)
        if slot is None:
            return None
        path = []
        if self.caching and reuse:
            # at least one token must be computed: its logits are what the step is for
            every = self.block_size // self.match_unit if whole_blocks else 1
            path = self.index.longest_state_match(token_ids, (len(token_ids) - 1) // self.match_unit, every)
        matched = len(path) * self.match_unit
        plan = CopyPlan()
        table: list[int] = []
        if path:
            # pin everything the match reads before allocating: an allocation may evict index entries
            src_slot = path[-1].state
            self.slots.pin(src_slot)
            plan.state_copies.append((src_slot, slot))
        full, partial = divmod(matched, self.block_size)
        units_per_block = self.block_size // self.match_unit
        for j in range(full):
            block = path[(j + 1) * units_per_block - 1].block  # last node of the range holds the whole range
            self.blocks.incref(block)
            table.append(block)
        if partial:
            src = path[-1].block
            self.blocks.incref(src)
            dst = self.blocks.allocate()
            if dst is None:
                self.blocks.decref(src)
                for block in reversed(table):
                    self.blocks.decref(block)
                for src_slot, _ in plan.state_copies:
                    self.slots.unpin(src_slot)
                self.slots.release_running(slot)
                return None
            plan.block_copies.append((src, dst, partial))
            table.append(dst)
        self._pending.block_copies += plan.block_copies
        self._pending.state_copies += plan.state_copies
        self.seqs[seq_id] = SeqCache(
            block_table=table, slot=slot, num_cached_tokens=matched, num_tokens_looked_up=len(token_ids)
        )
        self._count_admission(len(token_ids), matched, len(plan.block_copies), sign=1)
        return matched

    def cancel_admission(self, seq_id: int) -> None:
        """Undo :meth:`admit` of a sequence that could not be scheduled after all (before any step ran):
        drop its planned copies, release what it holds and take its lookup out of the counters."""
        seq = self._seq(seq_id)
        own_blocks = set(seq.block_table)
        dropped = CopyPlan(
            block_copies=[c for c in self._pending.block_copies if c[1] in own_blocks],
            state_copies=[c for c in self._pending.state_copies if c[1] == seq.slot],
        )
        self._pending.block_copies = [c for c in self._pending.block_copies if c[1] not in own_blocks]
        self._pending.state_copies = [c for c in self._pending.state_copies if c[1] != seq.slot]
        self._in_flight.append(dropped)
        self.finish_copies(dropped)
        self._count_admission(seq.num_tokens_looked_up, seq.num_cached_tokens, len(dropped.block_copies), sign=-1)
        self.free(seq_id)

    def _count_admission(self, num_tokens: int, matched: int, cow: int, sign: int) -> None:
        if not self.caching:
            return
        st = self.stats
        st.queries += sign
        st.query_tokens += sign * num_tokens
        if matched:
            st.hit_requests += sign
            st.hit_tokens += sign * matched
            st.state_restores += sign
            st.cow_copies += sign * cow

    def match_length(self, token_ids: Sequence[int]) -> int:
        """Prefix tokens :meth:`admit` would serve from the cache right now (no side effects, no counters)."""
        if not self.caching or len(token_ids) < 2:
            return 0
        return len(self.index.longest_state_match(token_ids, (len(token_ids) - 1) // self.match_unit)) * self.match_unit

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks the sequence needs so that its table covers ``num_tokens`` positions."""
        have = len(self._seq(seq_id).block_table)
        return max(0, -(-num_tokens // self.block_size) - have)

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the block table to cover ``num_tokens`` positions; False (nothing allocated) if out of blocks."""
        table = self._seq(seq_id).block_table
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:  # covered already (a decode step, most of the time)
            return True
        if need > self.blocks.num_available:
            return False
        for _ in range(need):
            block = self.blocks.allocate()
            if block is None:  # cannot happen after the availability check; keep the table consistent anyway
                return False
            table.append(block)
        return True

    def free(self, seq_id: int) -> None:
        """Release everything the sequence holds (finish, abort or preemption). Indexed blocks stay cached."""
        seq = self.seqs.pop(seq_id)
        for block in reversed(seq.block_table):  # parents released last = evicted last
            self.blocks.decref(block)
        self.slots.release_running(seq.slot)

    # ---- copies --------------------------------------------------------------------------------------------
    def take_copies(self) -> CopyPlan:
        """The copies planned since the last call; their sources stay pinned until :meth:`finish_copies`."""
        plan, self._pending = self._pending, CopyPlan()
        self._in_flight.append(plan)
        return plan

    def finish_copies(self, plan: CopyPlan) -> None:
        """Unpin the sources of executed copies."""
        self._in_flight = [p for p in self._in_flight if p is not plan]
        for src, _, _ in plan.block_copies:
            self.blocks.decref(src)
        for src, _ in plan.state_copies:
            self.slots.unpin(src)

    # ---- state saving --------------------------------------------------------------------------------------
    def plan_saves(
        self, seq_id: int, token_ids: Sequence[int], start: int, end: int, *, last_chunk: bool
    ) -> list[tuple[int, int]]:
        """Save points of a prefill chunk covering positions [start, end): (absolute position p, slot).

        A state is saved at every multiple of the alignment in (start, end] and, in the last chunk of a
        prefill, at its last match-unit boundary (where a later request extending this prompt can resume),
        unless that prefix already has a saved state; while slots last (allocating may evict LRU states).
        """
        self._seq(seq_id)
        if not self.caching:
            return []
        u, a = self.match_unit, self.config.alignment
        points = list(range((start // a + 1) * a, end + 1, a))
        tail = end // u * u
        if last_chunk and tail > start and (not points or points[-1] != tail):
            points.append(tail)
        if not points:
            return []
        path = self.index.walk(token_ids, points[-1] // u)
        saves: list[tuple[int, int]] = []
        for p in points:
            k = p // u
            if k <= len(path) and path[k - 1].state is not None:
                continue
            slot = self.slots.allocate_save()
            if slot is None:
                break
            self._pending_saves.add(slot)
            saves.append((p, slot))
        return saves

    def commit_prefill(self, seq_id: int, token_ids: Sequence[int], end: int, saves: Sequence[tuple[int, int]]) -> None:
        """After a prefill chunk ending at ``end`` ran: index its full units and publish the states saved at
        ``saves`` (from :meth:`plan_saves`); a state whose prefix gained one meanwhile is given back."""
        seq = self._seq(seq_id)
        if not self.caching:
            return
        path = self.index.insert(token_ids, end // self.match_unit, seq.block_table)
        for pos, slot in saves:
            self._pending_saves.discard(slot)
            if self.index.attach_state(path[pos // self.match_unit - 1], slot):
                self.stats.saved_states += 1
            else:
                self.slots.discard(slot)

    def abandon_saves(self, saves: Sequence[tuple[int, int]]) -> None:
        """Give back planned save slots of a step that did not run."""
        for _, slot in saves:
            self._pending_saves.discard(slot)
            self.slots.discard(slot)

    # ---- speculative decoding ------------------------------------------------------------------------------
    def allocate_spec_slots(self, count: int) -> list[int]:
        """Up to ``count`` private slots for the states after each drafted position of a verification step
        (never published: a speculative state is no prefix-cache entry). Given back by :meth:`settle_spec_slots`
        or :meth:`abandon_saves`."""
        slots: list[int] = []
        for _ in range(count):
            slot = self.slots.allocate_save()
            if slot is None:
                break
            self._pending_saves.add(slot)
            slots.append(slot)
        return slots

    def settle_spec_slots(self, seq_id: int, slots: Sequence[int], keep: int | None) -> None:
        """After a verification step: ``keep`` (one of ``slots``, or None when every draft was accepted) holds the
        state after the last accepted token and becomes the sequence's running slot; the rest are given back."""
        seq = self._seq(seq_id)
        for slot in slots:
            self._pending_saves.discard(slot)
            if slot != keep:
                self.slots.discard(slot)
        if keep is not None:
            if keep not in slots:
                raise ValueError(f"settle_spec_slots: slot {keep} is not one of {list(slots)}")
            self.slots.release_running(seq.slot)
            self.slots.adopt_running(keep, seq_id)
            seq.slot = keep

    # ---- introspection -------------------------------------------------------------------------------------
    def table(self, seq_id: int) -> list[int]:
        return self._seq(seq_id).block_table

    def slot(self, seq_id: int) -> int:
        return self._seq(seq_id).slot

    def pending_saves(self) -> set[int]:
        return set(self._pending_saves)

    def unfinished_copies(self) -> list[CopyPlan]:
        """Planned copies whose sources are still pinned (pending and taken-but-unfinished)."""
        return [self._pending, *self._in_flight]

    def _seq(self, seq_id: int) -> SeqCache:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"seq_id {seq_id} holds no cache (not admitted, or already freed)")
        return seq

    def _on_block_evicted(self, block: int) -> None:
        self.stats.block_evictions += 1
        self.index.on_block_evicted(block)

    def _on_state_evicted(self, slot: int) -> None:
        self.stats.state_evictions += 1
        self.index.on_state_evicted(slot)
