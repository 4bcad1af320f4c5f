"""LocalDistAttention: placement, block tables, frees, and fan-out + merge equal to one partition."""

import pytest
import torch

from infinite_llm.core.dist_attention import LocalDistAttention, SeqStepInput
from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.core.rmanager import KVLayout, RManager

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def _dist(blocks_per_holder):
    return LocalDistAttention([RManager(n, LAYOUT) for n in blocks_per_holder])


def test_new_blocks_go_to_the_holder_with_most_free():
    d = _dist([3, 3, 5])
    assert d.allocate("a", 4) == [(2, 0), (2, 1), (0, 0), (1, 0)]
    assert d.allocate("b", 2) == [(2, 2), (0, 1)]  # free was [2, 2, 3]
    assert d.block_table("a") == [(2, 0), (2, 1), (0, 0), (1, 0)]
    assert d.num_free_blocks == 5


def test_failed_allocation_changes_nothing_and_free_returns_every_block():
    d = _dist([2, 2])
    d.allocate("a", 3)
    with pytest.raises(CapacityExhausted):
        d.allocate("b", 2)
    assert d.num_free_blocks == 1 and d.block_table("b") == []
    assert d.free("a") == 3
    assert d.num_free_blocks == 4
    assert [h.pool.free_block_ids() for h in d.holders] == [[0, 1], [1, 0]]


def _run_steps(d, seq_lens, chunk, seed=0):
    """Prefill each sequence in chunks through ``d`` on random q/k/v; returns outputs of every step, layer 1."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    done = dict.fromkeys(seq_lens, 0)
    for sid, n in seq_lens.items():
        d.allocate(sid, -(-n // LAYOUT.block_size))
    while any(done[s] < seq_lens[s] for s in seq_lens):
        step = [SeqStepInput(s, done[s], min(chunk, seq_lens[s] - done[s])) for s in seq_lens if done[s] < seq_lens[s]]
        t = sum(s.num_new for s in step)
        attn = d.prepare(step)
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
