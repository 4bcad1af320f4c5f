"""Engine outputs do not depend on partition count, batch composition or preemption; blocks come back."""

from __future__ import annotations

import pytest

from infinite_llm.core.sampling import SamplingParams

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 100:",
    "The mitochondria is",
    "Translate to French: good morning, my friend.",
    "Once upon a time in a small village,",
    "import numpy as np\n# compute the mean of a list\n",
    "The three laws of thermodynamics are",
    "A recipe for pancakes needs",
    "Why is the sky blue?",
    "SELECT name FROM users WHERE",
    "The first person to walk on the moon was",
    "In 1492,",
    "Rust and Go differ in that",
    "The best way to learn a language is",
    "Dear hiring manager,",
    "E = mc^2 means that",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def reference(make_engine):
    """Each prompt alone, one partition: the tokens every other configuration must reproduce."""
    engine = make_engine(num_kv_blocks=128)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    return ids, [engine.generate([i], GREEDY)[0].token_ids for i in ids[:4]]


@pytest.mark.parametrize("num_partitions", [2, 3, 8])
def test_tokens_do_not_depend_on_the_partition_count(make_engine, reference, num_partitions):
    ids, ref = reference
    engine = make_engine(num_kv_blocks=128, num_partitions=num_partitions)
    assert [engine.generate([i], GREEDY)[0].token_ids for i in ids[:4]] == ref
    assert engine.kv.num_free_blocks == 128


def test_a_sequence_alone_equals_the_same_sequence_among_fifteen_others(make_engine, reference):
    ids, ref = reference
    engine = make_engine(num_kv_blocks=512, num_partitions=3)
    outs = engine.generate(ids, GREEDY)
    assert [o.token_ids for o in outs[:4]] == ref
    assert engine.kv.num_free_blocks == 512


def test_preemption_by_recompute_gives_the_same_tokens(make_engine, reference):
    ids, ref = reference
    # 16 sequences of ~10 + 24 tokens need ~3 blocks each at block_size 16; 24 blocks force preemption.
    engine = make_engine(num_kv_blocks=24, num_partitions=2)
    alone = [make_engine(num_kv_blocks=24).generate([i], GREEDY)[0].token_ids for i in ids[4:8]]
    outs = engine.generate(ids, GREEDY)
    assert engine.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs[:4]] == ref
    assert [o.token_ids for o in outs[4:8]] == alone
    assert engine.kv.num_free_blocks == 24


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(make_engine, reference):
    ids, _ = reference
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = make_engine(num_kv_blocks=64).generate([ids[0]], params)[0].token_ids
    crowded = make_engine(num_kv_blocks=12, num_partitions=3)  # 12 sequences, each needs 2+ blocks
    outs = crowded.generate(
        ids[:12], [params] + [SamplingParams(max_tokens=16, temperature=0.7, seed=s) for s in range(11)]
    )
    assert crowded.num_preemptions > 0
    assert outs[0].token_ids == alone
    other_seed = make_engine(num_kv_blocks=64).generate(
        [ids[0]], SamplingParams(max_tokens=16, temperature=0.9, seed=99)
    )
    assert other_seed[0].token_ids != alone
