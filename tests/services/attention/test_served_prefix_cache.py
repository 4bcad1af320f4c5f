"""An attention server's cached prefixes: attach the longest cached prefix, cache full rBlocks, no block freed
while read, LRU eviction reported to the manager, bad input refused; a reset (fenced out) drops them too."""

import pytest

from infinite_llm.core.errors import CapacityExhausted, InvalidRequest
from infinite_llm.core.prefix_cache import block_hashes
from infinite_llm.core.rmanager import KVLayout, RManager
from infinite_llm.services.attention.served_rmanager import ServedRManager


def test_reset_frees_sequences_and_drops_cached_prefixes():
    served = ServedRManager(RManager(4, KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)))
    r = served.reserve("s", 2)
    served.commit(r.reservation_id, [0, 1])
    h = block_hashes(list(range(8)), 4, "m")
    assert served.rm.cache_blocks("s", list(enumerate(h))) == [0, 1]
    assert served.reset() == 2
    pool = served.rm.pool
    assert (pool.num_cached, pool.num_free, served.rm.cached_block(h[0])) == (0, 4, None)


LAYOUT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)
H = block_hashes(list(range(12)), 4, "m")  # 3 chained block hashes


def _writer(served: ServedRManager, n: int = 3) -> list[int]:
    """Sequence "w" holds ``n`` rBlocks at logical 0..n-1 and caches them under ``H``; returns their ids."""
    r = served.reserve("w", n)
    ids = served.commit(r.reservation_id, list(range(n)))[1]
    assert served.cache_blocks("w", list(range(n)), H[:n]) == H[:n]
    return ids


def test_attach_takes_the_longest_cached_prefix_and_no_block_is_freed_while_read():
    served = ServedRManager(RManager(5, LAYOUT))
    ids = _writer(served, 2)  # blocks 0, 1 cached under H[0], H[1]
    assert served.cache_blocks("w", [0, 1], H[:2]) == []  # cached already: nothing new
    assert served.attach_prefix("r", 0, H) == ids  # H[2] is not cached here: the prefix stops at 2
    pool = served.rm.pool
    assert [pool.ref_count(b) for b in ids] == [2, 2]
    assert served.free_sequence("w") == 2  # the writer leaves; the reader still holds both
    assert [pool.ref_count(b) for b in ids] == [1, 1] and pool.free_block_ids() == [2, 3, 4]
    with pytest.raises(CapacityExhausted):
        served.reserve("x", 4)  # the read blocks are not free, and nothing is evicted
    assert served.free_sequence("r") == 2  # the last reader leaves: parked, still free and cached
    assert (pool.num_free, pool.num_cached_free, served.take_uncached()) == (5, 2, [])


def test_a_reservation_evicts_least_recently_used_parked_blocks_and_reports_their_hashes():
    served = ServedRManager(RManager(4, LAYOUT))
    ids = _writer(served, 3)
    served.free_sequence("w")  # parked in order 0, 1, 2 (least recently used first)
    r = served.reserve("x", 2)  # 1 plain free block, then the least recently used parked one
    assert list(r.block_ids) == [3, ids[0]]
    assert served.take_uncached() == [H[0]] and served.take_uncached() == []
    assert served.attach_prefix("y", 0, H) == []  # the chain starts with an evicted block: a miss
    assert served.attach_prefix("z", 1, H[1:]) == ids[1:]  # the rest is still cached
    served.cancel(r.reservation_id)
    served.free_sequence("z")
    assert served.rm.pool.num_free == 4


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda s: s.attach_prefix("r", 0, [b"short"]), InvalidRequest),
        (lambda s: s.attach_prefix("r", -1, H), InvalidRequest),
        (lambda s: s.attach_prefix("w", 0, H), InvalidRequest),  # "w" holds index 0 already
        (lambda s: s.cache_blocks("w", [0], H[:2]), InvalidRequest),
        (lambda s: s.cache_blocks("w", [5], [H[0]]), InvalidRequest),  # not held here
        (lambda s: s.cache_blocks("bad id", [0], [H[0]]), InvalidRequest),
    ],
)
def test_prefix_calls_refuse_bad_input_and_change_nothing(call, error):
    served = ServedRManager(RManager(4, LAYOUT))
    ids = _writer(served, 3)
    with pytest.raises(error):
        call(served)
    pool = served.rm.pool
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1] and pool.num_cached == 3
    assert served.occupancy() == ({"w": 3}, {})
