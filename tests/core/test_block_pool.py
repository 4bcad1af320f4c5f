"""rBlock pool: exact ids and free-list order, reserve-then-commit, reference counts, failures change nothing."""

import pytest

from infinite_llm.core.block_pool import RBlockPool
from infinite_llm.core.errors import CapacityExhausted, InvalidRequest, NotFound


def _snapshot(pool):
    return (pool.free_block_ids(), [pool.ref_count(b) for b in range(pool.num_blocks)], pool.num_reserved)


def test_fresh_pool_allocates_ids_in_order():
    pool = RBlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    assert (pool.num_used, pool.num_free) == (5, 1)


def test_freed_blocks_go_to_the_back_in_the_order_given():
    pool = RBlockPool(6)
    pool.allocate(4)  # 0 1 2 3
    pool.free([2, 0])
    assert pool.free_block_ids() == [4, 5, 2, 0]
    assert pool.allocate(3) == [4, 5, 2]
    pool.free([3, 1])
    assert pool.free_block_ids() == [0, 3, 1]


def test_failed_allocation_changes_nothing():
    pool = RBlockPool(4)
    pool.allocate(3)
    pool.free([1])
    before = _snapshot(pool)
    with pytest.raises(CapacityExhausted, match="need 3 rBlocks, only 2 of 4 free"):
        pool.allocate(3)
    with pytest.raises(CapacityExhausted):
        pool.reserve(3)
    assert _snapshot(pool) == before


def test_reserve_then_commit_publishes_blocks():
    pool = RBlockPool(5)
    r = pool.reserve(2)
    assert r.block_ids == (0, 1)
    assert (pool.num_free, pool.num_reserved, pool.num_used) == (3, 2, 0)
    assert pool.ref_count(0) == 0  # reserved, not yet readable
    assert pool.commit(r.reservation_id) == [0, 1]
    assert (pool.num_free, pool.num_reserved, pool.num_used) == (3, 0, 2)
    with pytest.raises(NotFound):
        pool.commit(r.reservation_id)  # a reservation commits once


def test_cancelled_reservation_returns_blocks_to_the_back():
    pool = RBlockPool(4)
    r = pool.reserve(2)
    pool.cancel(r.reservation_id)
    assert pool.free_block_ids() == [2, 3, 0, 1]
    assert pool.num_reserved == 0


def test_shared_block_is_freed_when_the_last_reference_drops():
    pool = RBlockPool(3)
    (b,) = pool.allocate(1)
    pool.share(b)
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.free_block_ids() == [1, 2]
    pool.free([b])
    assert pool.free_block_ids() == [1, 2, 0]


def test_bad_free_frees_nothing():
    pool = RBlockPool(4)
    pool.allocate(2)
    before = _snapshot(pool)
    with pytest.raises(InvalidRequest, match="block 3 is not in use"):
        pool.free([0, 3])
    with pytest.raises(InvalidRequest, match="out of range"):
        pool.free([9])
    with pytest.raises(InvalidRequest, match="freed more times"):
        pool.free([1, 1])
    assert _snapshot(pool) == before


def test_capacity_from_bytes_counts_whole_blocks():
    assert RBlockPool.from_bytes(10_000, 3_000).num_blocks == 3
    assert RBlockPool.from_bytes(2_999, 3_000).num_blocks == 0


def test_a_reservation_of_cached_blocks_holds_references_until_commit_or_cancel():
    pool = RBlockPool(4)
    w = pool.allocate(2)
    for b in w:
        pool.mark_cached(b)
    pool.free([w[1]])  # block 1 parked: cached, no reader
    before = (pool.num_free, pool.num_reserved, pool.num_cached_free)
    r = pool.reserve_cached(w)
    assert r.block_ids == tuple(w) and pool.reserved_ids(r.reservation_id) == tuple(w)
    assert [pool.ref_count(b) for b in w] == [2, 1]  # block 1 revived: it cannot be evicted meanwhile
    assert (pool.num_free, pool.num_reserved) == (2, 0)  # referenced blocks are in use, not reserved
    pool.cancel(r.reservation_id)  # references dropped: block 1 parked again
    assert (pool.num_free, pool.num_reserved, pool.num_cached_free) == before
    r = pool.reserve_cached(w)
    assert pool.commit(r.reservation_id) == w  # the references are handed over as they are
    assert [pool.ref_count(b) for b in w] == [2, 1]
    with pytest.raises(NotFound):
        pool.cancel(r.reservation_id)


def test_a_reservation_of_an_uncached_block_is_refused_and_changes_nothing():
    pool = RBlockPool(4)
    a = pool.allocate(2)
    pool.mark_cached(a[0])
    snap = _snapshot(pool)
    with pytest.raises(InvalidRequest, match="block 1 is not cached"):
        pool.reserve_cached(a)
    assert _snapshot(pool) == snap
