"""An attention server's cached prefixes: a reset (fenced out, rejoining empty) drops them too."""

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
