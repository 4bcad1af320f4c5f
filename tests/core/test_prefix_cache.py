"""Prefix caching in the core: block hashes, the pool's LRU of cached rBlocks, sharing on rManagers."""

import pytest

from infinite_llm.core.block_pool import RBlockPool
from infinite_llm.core.dist_attention import DistAttention
from infinite_llm.core.errors import CapacityExhausted, InvalidRequest
from infinite_llm.core.local_transport import LocalPlacement, LocalTransport, partition_id
from infinite_llm.core.prefix_cache import block_hashes, max_cache_hit_tokens
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep

LAYOUT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4)


def test_block_hash_is_a_chain_over_tokens_model_and_block_size():
    a = block_hashes(list(range(10)), 4, "m")
    assert len(a) == 2  # the partial last block (tokens 8, 9) has no hash
    assert all(len(h) == 32 for h in a)
    assert a == block_hashes(list(range(8)), 4, "m")  # stable: no per-process salt
    assert block_hashes(list(range(4, 8)), 4, "m", parent=a[0]) == a[1:]  # the chain continues from a parent
    b = block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4, "m")
    assert b[0] == a[0] and b[1] != a[1]
    c = block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, "m")
    assert c[0] != a[0] and c[1] != a[1]  # same tokens in block 1, another parent: another block
    assert block_hashes(list(range(8)), 4, "other")[0] != a[0]
    assert block_hashes(list(range(8)), 8, "m")[0] not in a
    assert block_hashes(list(range(10)), 4, "m", num_tokens=7) == a[:1]


@pytest.mark.parametrize(("num_tokens", "hit"), [(0, 0), (1, 0), (4, 0), (5, 4), (8, 4), (9, 8)])
def test_at_most_the_full_blocks_before_the_last_token_can_hit(num_tokens, hit):
    assert max_cache_hit_tokens(num_tokens, 4) == hit


def test_cached_blocks_with_no_reader_are_evicted_lru_and_only_when_plain_free_blocks_run_out():
    evicted: list[int] = []
    pool = RBlockPool(6, on_evict=evicted.extend)
    a = pool.allocate(4)  # 0 1 2 3
    for b in (0, 1, 2):
        pool.mark_cached(b)
    pool.free([1, 0, 3])  # 1 then 0 parked (LRU order), 3 plain free
    assert (pool.num_free, pool.num_cached, pool.num_cached_free) == (5, 3, 2)
    assert pool.free_block_ids() == [4, 5, 3, 1, 0]
    pool.revive(1)  # a hit: 1 is read again, no longer evictable
    assert pool.ref_count(1) == 1 and pool.free_block_ids() == [4, 5, 3, 0]
    assert pool.allocate(3) == [4, 5, 3] and evicted == []  # plain free blocks first
    assert pool.allocate(1) == [0] and evicted == [0]  # then the least recently used parked block
    with pytest.raises(CapacityExhausted):
        pool.allocate(1)  # 1 and 2 are read: never evicted
    assert pool.is_cached(1) and pool.is_cached(2) and not pool.is_cached(0)
    pool.free([2, 1])
    assert pool.free_block_ids() == [2, 1]
    assert pool.evict_cached() == [2, 1] and evicted == [0, 2, 1]
    assert pool.num_cached == 0 and pool.free_block_ids() == [2, 1]  # parked order kept, now plain free
    assert a == [0, 1, 2, 3]


def _holders(n_holders=2, blocks=4):
    holders = {partition_id(p): RManager(blocks, LAYOUT) for p in range(n_holders)}
    return holders, DistAttention(LocalPlacement(holders), LocalTransport(holders), 4, prefix_cache_model_id="m")


def test_a_hit_shares_the_blocks_by_reference_across_holders_and_counts_tokens():
    holders, kv = _holders()
    tokens = list(range(1, 11))  # 2 full blocks + 2 tokens
    assert kv.match_prefix("a", tokens) == 0
    assert kv.try_allocate("a", 3)
    assert kv.cache_computed("a", tokens, 10) == 2  # blocks 0, 1 full; the partial block 2 stays private
    table_a = kv.block_table("a")
    assert {r.holder for r in table_a[:2]} == {partition_id(0), partition_id(1)}
    assert kv.match_prefix("b", tokens + [99]) == 8
    assert kv.block_table("b") == table_a[:2]
    assert [holders[r.holder].pool.ref_count(r.block_id) for r in table_a[:2]] == [2, 2]
    # a lookup counts once its sequence is admitted (its first allocation), not at each try
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    assert kv.try_allocate("b", 1)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 2  # parked, counted free
    assert kv.clear_prefix_cache() == 2 and kv.num_cached_blocks == 0
    assert all(rm.pool.num_free == 4 and rm.sequences() == [] for rm in holders.values())


def test_a_step_never_writes_into_a_cached_block():
    holders, kv = _holders(n_holders=1, blocks=4)
    tokens = list(range(1, 9))
    kv.try_allocate("a", 2)
    kv.cache_computed("a", tokens, 4)  # block 0 cached
    rm = holders[partition_id(0)]
    with pytest.raises(InvalidRequest, match="would write into cached rBlocks"):
        rm.plan_step([SeqStep("a", 3, 2)])  # tokens 3, 4: token 3 lands in cached block 0
    assert rm.plan_step([SeqStep("a", 4, 4)]).num_new_here == 4


def test_an_allocation_evicts_only_blocks_no_sequence_reads():
    holders, kv = _holders(n_holders=1, blocks=4)
    tokens = list(range(1, 13))  # 3 full blocks
    kv.try_allocate("a", 3)
    assert kv.cache_computed("a", tokens, 12) == 3
    kv.free("a")  # 3 cached blocks, parked
    assert kv.match_prefix("b", tokens[:9]) == 8  # b reads blocks 0 and 1; block 2 stays parked
    shared = [r.block_id for r in kv.block_table("b")]
    assert not kv.try_allocate("c", 3)  # 1 plain free + 1 parked: the 2 read blocks are not evictable
    assert kv.try_allocate("c", 2) and kv.num_cached_blocks == 2  # took the plain one, evicted block 2
    rm = holders[partition_id(0)]
    assert [rm.pool.ref_count(b) for b in shared] == [1, 1] and all(rm.pool.is_cached(b) for b in shared)
    kv.free("b")
    kv.free("c")
    assert kv.clear_prefix_cache() == 2 and rm.pool.num_free == 4


def test_the_scheduler_starts_a_new_sequence_after_its_cached_prefix():
    from infinite_llm.core.sampling import SamplingParams
    from infinite_llm.core.scheduler import Scheduler, SchedulerConfig, Sequence

    holders, kv = _holders(n_holders=2, blocks=8)
    sched = Scheduler(SchedulerConfig(8, 64), kv)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    a = Sequence("a", list(range(1, 11)), greedy)
    sched.add(a)
    out = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new) for s in out.scheduled] == [(0, 10)]
    sched.mark_computed(out)  # blocks 0 and 1 of a (tokens 1..8) are published
    a.output_token_ids.append(7)
    assert kv.num_cached_blocks == 2
    b = Sequence("b", list(range(1, 10)) + [42], greedy)  # the same 9 first tokens
    c = Sequence("c", list(range(1, 9)), greedy)  # exactly 2 blocks: its last block is recomputed
    logprobs = Sequence("d", list(range(1, 10)), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    for seq in (b, c, logprobs):
        sched.add(seq)
    out = sched.schedule()
    got = [(s.seq.seq_id, s.num_computed_tokens, s.num_new) for s in out.scheduled]
    assert got == [("a", 10, 1), ("b", 8, 2), ("c", 4, 4), ("d", 0, 9)]
    table_a = kv.block_table("a")
    assert kv.block_table("b")[:2] == table_a[:2] and kv.block_table("c")[:1] == table_a[:1]
    assert not set(kv.block_table("d")) & set(table_a)  # asks for prompt log-probabilities: computes all
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 10 + 8, 8 + 4)
