"""The block pool's bulk operations: several blocks at once, in the order single calls take them."""

import pytest

from shared.engine import EngineError
from shared.engine.block_pool import BlockPool


def _cached_pool() -> tuple[BlockPool, list[int]]:
    """A pool of 6: blocks 0-3 hold hashes 10-13 and are free again, freed in that order."""
    pool = BlockPool(6)
    ids = pool.allocate_many(4)
    assert ids == [0, 1, 2, 3]
    assert pool.register_or_share_many(ids, [10, 11, 12, 13]) == ids
    pool.release_many(ids)
    pool.drain_events()
    return pool, ids


def test_release_many_keeps_hashed_blocks_in_order_and_reuses_plain_ones_first():
    pool, _ = _cached_pool()
    plain = pool.allocate_many(2)  # the two never-hashed blocks: reused before any cached one
    assert plain == [4, 5] and pool.drain_events() == []
    pool.release_many(plain)
    assert list(pool.free) == [5, 4, 0, 1, 2, 3]  # each plain one goes to the front as it is released


def test_allocate_many_evicts_the_least_recently_freed_in_order():
    pool, _ = _cached_pool()
    pool.allocate_many(2)  # blocks 4 and 5
    assert pool.allocate_many(3) == [0, 1, 2]
    assert pool.drain_events() == [("evicted", 10), ("evicted", 11), ("evicted", 12)]
    assert pool.lookup([13]) == [3] and pool.lookup([10]) == []
    with pytest.raises(EngineError):
        pool.allocate_many(2)  # one left: none is taken
    assert pool.num_free == 1


def test_touch_many_and_sharing_twins_in_bulk():
    pool, ids = _cached_pool()
    pool.touch_many(pool.lookup([10, 11]))  # a prefix hit of two blocks
    assert [pool.blocks[b].ref_count for b in ids] == [1, 1, 0, 0] and pool.num_free == 4
    fresh = pool.allocate_many(2)  # blocks 4, 5 computed 12 (a twin of block 2) and 20
    assert pool.register_or_share_many(fresh, [12, 20]) == [2, 5]
    assert pool.blocks[2].ref_count == 1 and pool.blocks[4].ref_count == 0  # 4 went back
    assert pool.drain_events() == [("stored", 20)]
    with pytest.raises(EngineError):
        pool.release_many([5, 5])  # the second release has no reference left
