"""DistAttention over in-process holders: placement, block tables, frees, step plans, fan-out + merge."""

import pytest
import torch

from infinite_llm.core.attention import partial_attention
from infinite_llm.core.dist_attention import BlockRef, DistAttention
from infinite_llm.core.errors import InvalidRequest, NotFound
from infinite_llm.core.local_transport import LocalPlacement, LocalTransport, partition_id
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
P0, P1, P2 = (partition_id(p) for p in range(3))


def _dist(blocks_per_holder):
    holders = {partition_id(p): RManager(n, LAYOUT) for p, n in enumerate(blocks_per_holder)}
    return DistAttention(LocalPlacement(holders), LocalTransport(holders), LAYOUT.block_size)


def test_new_blocks_go_to_the_holder_with_most_free():
    d = _dist([3, 3, 5])
    assert d.try_allocate("a", 4)
    assert d.block_table("a") == [BlockRef(P2, 0), BlockRef(P2, 1), BlockRef(P0, 0), BlockRef(P1, 0)]
    assert d.try_allocate("b", 2)
    assert d.block_table("b") == [BlockRef(P2, 2), BlockRef(P0, 1)]  # free was [2, 2, 3]
    assert d.num_free_blocks == 5


def test_growth_names_the_holder_of_the_last_rblock_as_near_and_follows_a_flipped_table():
    """The placement is told where the sequence's last rBlock lives (``None`` for its first), so a placement
    that honours it (the manager's) keeps a growing sequence on few holders; after a migration's flip the
    hint is the new table's."""
    holders = {partition_id(p): RManager(8, LAYOUT) for p in range(3)}
    asked = []

    class Recording(LocalPlacement):
        def place(self, seq_id, n, first_index, near=None):  # noqa: ANN001, ANN201
            asked.append((seq_id, first_index, near))
            return super().place(seq_id, n, first_index, near)

    d = DistAttention(Recording(holders), LocalTransport(holders), LAYOUT.block_size)
    assert d.try_allocate("a", 2) and d.try_allocate("a", 1)
    last = d.block_table("a")[1].holder
    assert asked == [("a", 0, None), ("a", 2, last)]
    moved = [BlockRef(P2, 7)] * 3  # the table a migration flipped to (same length)
    d.replace_table("a", moved)
    assert d.try_allocate("a", 1)
    assert asked[-1] == ("a", 3, P2)


def test_holders_record_the_logical_index_of_each_rblock_at_commit():
    d = _dist([3, 3, 5])
    d.try_allocate("a", 4)
    d.try_allocate("a", 2)  # indices 4, 5 go to [P2 (free 3), P0 (free 2, first on a tie)]
    holders = d.placement.holders
    assert holders[P2].block_indices("a", holders[P2].owned_blocks("a")) == [0, 1, 4]
    assert holders[P0].block_indices("a", holders[P0].owned_blocks("a")) == [2, 5]
    assert holders[P1].block_indices("a", holders[P1].owned_blocks("a")) == [3]


def test_failed_allocation_changes_nothing_and_free_returns_every_block():
    d = _dist([2, 2])
    assert d.try_allocate("a", 3)
    assert not d.try_allocate("b", 2)
    assert d.num_free_blocks == 1 and d.block_table("b") == []
    assert d.free("a") == 3
    assert d.num_free_blocks == 4
    assert [h.pool.free_block_ids() for h in d.placement.holders.values()] == [[0, 1], [1, 0]]


def test_a_holder_plans_a_step_from_its_own_records():
    """Block size 4, a sequence of 10 tokens over P0 (blocks 0, 2) and P1 (block 1): the plan of a 3-token
    step from position 7 needs no block id from the caller."""
    holders = {P0: RManager(4, LAYOUT), P1: RManager(4, LAYOUT)}
    holders[P0].allocate("s", [0, 2])
    holders[P1].allocate("s", [1])
    plan0 = holders[P0].plan_step([SeqStep("s", 7, 3)])
    plan1 = holders[P1].plan_step([SeqStep("s", 7, 3)])
    assert plan0.meta.block_ids.tolist() == [[0, 1]] and plan0.meta.block_indices.tolist() == [[0, 2]]
    assert plan0.slot_mapping.tolist() == [1 * 4 + 0, 1 * 4 + 1]  # positions 8, 9 live in block 2 (id 1)
    assert plan1.slot_mapping.tolist() == [0 * 4 + 3]  # position 7 lives in block 1 (id 0 on P1)
    assert plan0.meta.query_positions.tolist() == [7, 8, 9] == plan1.meta.query_positions.tolist()
    assert plan0.meta.context_lens.tolist() == [10]


def test_a_plan_hands_the_kernel_its_longest_query_run():
    """The kernel launcher reads the longest query run from the plan, not back from the device (a host sync
    per layer on a GPU): 3 new tokens of "s" and 1 of "t" give 3."""
    seen = []

    def recording(query, k_cache, v_cache, meta, scale=None, max_query_len=None):  # noqa: ANN001, ANN202
        seen.append(max_query_len)
        return partial_attention(query, k_cache, v_cache, meta, scale)

    rm = RManager(4, LAYOUT, attention_impl=recording)
    rm.allocate("s", [0, 1, 2])
    rm.allocate("t", [0])
    plan = rm.plan_step([SeqStep("s", 7, 3), SeqStep("t", 2, 1)])
    assert plan.max_query_len == 3
    q, kv = torch.zeros(4, 4, 8), torch.zeros(4, 2, 8)
    rm.attend(0, plan, q, kv, kv)
    assert seen == [3]


def test_a_plan_is_void_once_its_sequence_is_freed():
    rm = RManager(4, LAYOUT)
    rm.allocate("s", [0])
    plan = rm.plan_step([SeqStep("s", 0, 2)])
    rm.free_sequence("s")
    rm.allocate("t", [0])  # reuses the block
    q, kv = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    with pytest.raises(NotFound):
        rm.attend(0, plan, q, kv, kv)


def test_a_step_longer_than_the_block_table_is_refused():
    d = _dist([4])
    d.try_allocate("a", 1)
    with pytest.raises(InvalidRequest):
        d.prepare([SeqStep("a", 0, 5)], num_heads=4)


def _run_steps(d, seq_lens, chunk, seed=0):
    """Prefill each sequence in chunks through ``d`` on random q/k/v; returns outputs of every step, layer 1."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    done = dict.fromkeys(seq_lens, 0)
    for sid, n in seq_lens.items():
        assert d.try_allocate(sid, -(-n // LAYOUT.block_size))
    while any(done[s] < seq_lens[s] for s in seq_lens):
        step = [SeqStep(s, done[s], min(chunk, seq_lens[s] - done[s])) for s in seq_lens if done[s] < seq_lens[s]]
        t = sum(s.num_new for s in step)
        with d.prepare(step, num_heads=4) as attn:
            for layer in range(LAYOUT.num_layers):
                q = torch.randn(t, 4, 8, generator=g)
                k = torch.randn(t, 2, 8, generator=g)
                v = torch.randn(t, 2, 8, generator=g)
                o = attn(layer, q, k, v)
                if layer == 1:
                    outs.append(o)
        for s in step:
            done[s.seq_id] += s.num_new
    return outs


@pytest.mark.parametrize("holders", [[40, 40, 40], [7, 30, 1, 20], [5] * 8])
def test_fan_out_and_merge_equals_a_single_holder(holders):
    seq_lens = {"a": 1, "b": 4, "c": 5, "d": 17, "e": 31}
    ref = _run_steps(_dist([sum(holders)]), seq_lens, chunk=3)
    got = _run_steps(_dist(holders), seq_lens, chunk=3)
    assert len(ref) == len(got)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


class _PinnedPlacement(LocalPlacement):
    """Every rBlock of a sequence on the holder ``pins`` names for it (the mesh keeps a sequence on one
    server while it fits)."""

    def __init__(self, holders, pins):
        super().__init__(holders)
        self.pins = pins

    def place(self, seq_id, n, first_index, near=None):
        holder = self.pins[seq_id]
        ids = self.holders[holder].allocate(seq_id, list(range(first_index, first_index + n)))
        return [BlockRef(holder, i) for i in ids]


def test_a_step_whose_sequences_each_sit_on_one_holder_scatters_the_partials_and_equals_a_single_holder():
    """The merge's fast path: every query row has one holder, so its partial is the output (no weights)."""
    holders = {p: RManager(40, LAYOUT) for p in (P0, P1, P2)}
    pins = {"a": P0, "b": P1, "c": P2, "d": P1, "e": P0}
    pinned = DistAttention(_PinnedPlacement(holders, pins), LocalTransport(holders), LAYOUT.block_size)
    seq_lens = {"a": 1, "b": 4, "c": 5, "d": 17, "e": 31}
    seen = []
    prepare = pinned.prepare
    pinned.prepare = lambda seqs, num_heads: seen.append(prepare(seqs, num_heads)) or seen[-1]
    got = _run_steps(pinned, seq_lens, chunk=3)
    assert all(step.disjoint for step in seen) and max(len(step.rows) for step in seen) == 3
    ref = _run_steps(_dist([120]), seq_lens, chunk=3)
    assert len(ref) == len(got)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


def test_a_step_with_one_sequence_spread_over_holders_is_merged_not_scattered():
    d = _dist([2, 2])  # most-free placement alternates: "a"'s 3 rBlocks span both holders
    assert d.try_allocate("a", 3) and d.try_allocate("b", 1)
    with d.prepare([SeqStep("a", 8, 1), SeqStep("b", 0, 1)], num_heads=4) as step:
        assert not step.disjoint
