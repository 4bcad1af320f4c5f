"""Prefix caching in the engine: greedy tokens with a hit equal those of an engine without the feature,
around block boundaries, for requests that arrive together, after eviction; the pool returns to baseline."""

from __future__ import annotations

import pytest

from infinite_llm.core.sampling import SamplingParams
from tests.conftest import LONG_DOCUMENT

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def prompt(default_weights):
    tokenizer = default_weights[2]
    return tokenizer.encode(open(LONG_DOCUMENT, encoding="utf-8").read()[:6000])


@pytest.fixture(scope="module")
def reference(make_engine):
    """Greedy tokens of an engine without prefix caching (itself equal to HF: ``test_engine_vs_hf``)."""
    engine = make_engine(block_size=BS, num_kv_blocks=64, enable_prefix_caching=False)
    return lambda ids: engine.generate([ids], GREEDY)[0].token_ids


def _assert_baseline(engine) -> None:
    """No reader left: every rBlock is free or parked in the cache; clearing the cache frees them all."""
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.clear_prefix_cache()
    for rm in engine.kv.transport.holders.values():
        pool = rm.pool
        assert (pool.num_cached, rm.sequences()) == (0, [])
        assert sorted(pool.free_block_ids()) == list(range(pool.num_blocks))
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [0] * pool.num_blocks


@pytest.mark.parametrize("length", [BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1])
def test_a_hit_gives_the_tokens_of_a_cold_run_around_block_boundaries(make_engine, reference, prompt, length):
    engine = make_engine(block_size=BS, num_kv_blocks=64, num_partitions=2)
    ids = prompt[:length]
    longer = prompt[: length + 5]
    cold = engine.generate([ids], GREEDY)[0].token_ids
    hits0 = engine.kv.prefix_cache_hits
    warm = engine.generate([ids], GREEDY)[0].token_ids
    assert engine.kv.prefix_cache_hits - hits0 == (length - 1) // BS * BS  # never the last token's block
    warm_longer = engine.generate([longer], GREEDY)[0].token_ids
    assert engine.kv.prefix_cache_hits - hits0 == (length - 1) // BS * BS + length // BS * BS
    assert cold == warm == reference(ids)
    assert warm_longer == reference(longer)
    _assert_baseline(engine)


def test_requests_sharing_a_prefix_in_one_batch_and_after_eviction(make_engine, reference, prompt):
    # 14 rBlocks: a 100-token request (+6 tokens) holds 7, a 200-token one 13: it must evict cached blocks
    engine = make_engine(block_size=BS, num_kv_blocks=14, num_partitions=2)
    a, b = prompt[:100], prompt[:90] + prompt[200:210]  # the same first 5 full blocks
    ref_a, ref_b = reference(a), reference(b)
    outs = engine.generate([a, b], GREEDY)  # both admitted in one step: neither hits, both compute
    assert [o.token_ids for o in outs] == [ref_a, ref_b]
    assert engine.kv.prefix_cache_hits == 0
    assert engine.kv.num_cached_blocks == 7  # a: 6 full blocks of its 105 computed tokens; b: 1 more (5 shared)
    other = prompt[400:600]
    assert engine.generate([other], GREEDY)[0].token_ids == reference(other)  # evicts LRU cached blocks
    assert engine.kv.prefix_cache_hits == 0
    hits = engine.kv.prefix_cache_hits
    assert engine.generate([a], GREEDY)[0].token_ids == ref_a  # what is left of a's prefix, or a recompute
    assert engine.kv.prefix_cache_hits - hits in range(0, 96, BS)  # some of a's 6 cacheable blocks were evicted
    _assert_baseline(engine)


def test_a_request_waiting_for_memory_counts_its_lookup_once(make_engine, reference, prompt):
    """``b`` shares ``a``'s first 3 full blocks and waits behind it for memory (10 rBlocks: ``a`` holds 5-6
    of them for 20 decode steps, ``b`` needs 7 beside the 3 it shares). It looks the cache up at every step
    it tries to be admitted; only the lookup of its admission counts in ``prefix_cache_queries`` / ``_hits``
    (found on a mesh: 414,143 tokens queried for 3 requests of 3,031 prompt tokens while they waited)."""
    engine = make_engine(block_size=BS, num_kv_blocks=10, num_partitions=2)
    a, b = prompt[:70], prompt[:48] + prompt[300:400]  # 70 + 20 = 90 tokens: 6 rBlocks; 148 + 6: 10
    long_a = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request(a, long_a, request_id="a")
    engine.step()  # a is running
    engine.add_request(b, GREEDY, request_id="b")
    steps = 1
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps > 20 and engine.scheduler.num_preemptions == 0  # b tried to get in at each of a's steps
    # a: 70 tokens, no hit (cold); b: 148 tokens, the 3 blocks it shares with a's prompt, cached
    assert (engine.kv.prefix_cache_queries, engine.kv.prefix_cache_hits) == (70 + 148, 3 * BS)
    _assert_baseline(engine)
