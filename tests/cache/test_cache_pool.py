"""BlockPool / KDASlotPool bookkeeping: states, LRU eviction order, eviction callback, misuse errors."""

from __future__ import annotations

import pytest

from rocm_k3.cache.block_pool import BlockPool
from rocm_k3.cache.kda_slots import KDASlotPool


def test_allocate_until_exhausted_then_free():
    pool = BlockPool(3)
    ids = [pool.allocate() for _ in range(3)]
    assert sorted(ids) == [0, 1, 2] and pool.allocate() is None
    pool.decref(ids[1])
    assert pool.is_free(ids[1]) and pool.allocate() == ids[1]


def test_cached_ids_are_evicted_in_lru_order_with_callback():
    evicted = []
    pool = BlockPool(3, on_evict=evicted.append)
    a, b, c = (pool.allocate() for _ in range(3))
    for i in (a, b, c):
        pool.mark_cached(i)
    pool.decref(b)  # released first -> evicted first
    pool.decref(a)
    pool.decref(c)
    assert pool.num_free == 0 and pool.num_evictable == 3
    pool.incref(a)  # a cache hit takes it out of the LRU
    assert pool.allocate() == b and pool.allocate() == c and pool.allocate() is None
    assert evicted == [b, c] and pool.num_evictions == 2
    assert not pool.is_cached(b)


def test_uncache_moves_unreferenced_id_to_free_list():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.mark_cached(a)
    pool.decref(a)
    assert pool.evictable_ids() == [a]
    pool.uncache(a)
    assert pool.evictable_ids() == [] and a in pool.free_ids()


@pytest.mark.parametrize("op", ["decref", "incref"])
def test_misuse_of_free_id_raises(op):
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="free|unreferenced"):
        getattr(pool, op)(0)


def test_bad_size_and_id():
    with pytest.raises(ValueError, match="pool size"):
        BlockPool(0)
    with pytest.raises(IndexError, match="out of range"):
        BlockPool(2).refcount(5)


def test_slot_pool_roles():
    slots = KDASlotPool(3)
    run = slots.allocate_running(seq_id=7)
    save = slots.allocate_save()
    assert slots.owner(run) == 7 and slots.owner(save) is None
    with pytest.raises(RuntimeError, match="running slot"):
        slots.publish(run)
    slots.publish(save)
    assert slots.pool.is_cached(save) and slots.pool.refcount(save) == 0
    slots.pin(save)
    with pytest.raises(RuntimeError, match="not a saved state"):
        slots.pin(run)
    slots.unpin(save)
    slots.release_running(run)
    assert slots.pool.num_free == 2 and slots.pool.num_evictable == 1
