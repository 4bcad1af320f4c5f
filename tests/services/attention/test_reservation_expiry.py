"""Orphaned reservations (the manager died between reserve and commit) expire instead of leaking rBlocks."""

from infinite_llm.core.rmanager import KVLayout, RManager
from infinite_llm.services.attention.served_rmanager import ServedRManager

LAYOUT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4)


def test_reservation_older_than_the_ttl_is_cancelled_on_the_next_reserve():
    now = [100.0]
    holder = ServedRManager(RManager(6, LAYOUT), reservation_ttl_s=30.0, clock=lambda: now[0])
    orphan = holder.reserve("a", 4)
    now[0] += 10.0
    kept = holder.reserve("b", 1)
    assert holder.rm.pool.num_free == 1 and holder.rm.pool.num_reserved == 5
    now[0] += 25.0  # the orphan is 35 s old, the other 25 s
    fresh = holder.reserve("c", 2)
    assert holder.rm.pool.num_reserved == 3  # orphan's 4 blocks came back; b and c are held
    assert (orphan.block_ids, kept.block_ids) == ((0, 1, 2, 3), (4,))
    assert fresh.block_ids == (5, 0)  # free list: 5, then the orphan's blocks returned to the back
    assert holder.commit(kept.reservation_id, [0]) == ("b", list(kept.block_ids), [])


def test_committed_blocks_never_expire():
    now = [0.0]
    holder = ServedRManager(RManager(4, LAYOUT), reservation_ttl_s=1.0, clock=lambda: now[0])
    r = holder.reserve("a", 2)
    holder.commit(r.reservation_id, [0, 1])
    now[0] += 100.0
    assert holder.expire_reservations() == 0
    assert holder.rm.owned_blocks("a") == list(r.block_ids)


def test_an_orphaned_reservation_of_cached_blocks_expires_and_drops_its_references():
    """A migration's re-attach reservation whose order never came (the manager or the reader's instance
    died): it expires like any reservation, and the cached blocks it referenced go back to their readers."""
    now = [0.0]
    holder = ServedRManager(RManager(4, LAYOUT), reservation_ttl_s=30.0, clock=lambda: now[0])
    r = holder.reserve("w", 2)
    holder.commit(r.reservation_id, [0, 1])
    hashes = [bytes([i]) * 32 for i in range(2)]
    assert holder.cache_blocks("w", [0, 1], hashes) == hashes
    held = holder.reserve_prefix("x", [*hashes, b"\x09" * 32])  # the third is not cached here
    assert held.block_ids == r.block_ids and [holder.rm.pool.ref_count(b) for b in r.block_ids] == [2, 2]
    assert holder.occupancy() == ({"w": 2}, {"x": 2})
    now[0] += 31.0
    assert holder.expire_reservations() == 1
    assert [holder.rm.pool.ref_count(b) for b in r.block_ids] == [1, 1] and holder.occupancy() == ({"w": 2}, {})
