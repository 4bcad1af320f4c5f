"""Partial attention + exact merge equals monolithic attention (torch SDPA), over random partitions."""

import math
import random

import pytest
import torch

from infinite_llm.core.attention import PartialAttentionMetadata, merge_partials, partial_attention, write_kv

TOL = 1e-5


def _sdpa(q, k, v, q_positions):
    """Reference: q [T, H, D], k/v [S, Hkv, D] (all keys of the sequence), causal by absolute position."""
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    mask = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]  # (T, S)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def _store(seqs_kv, block_size, num_kv_heads, head_dim, rng):
    """Scatter each sequence's K/V into a shuffled paged pool; returns caches and per-seq block ids."""
    total = sum(-(-k.shape[0] // block_size) for k, _ in seqs_kv)
    free = list(range(total + 3))
    rng.shuffle(free)
    k_cache = torch.randn(total + 3, block_size, num_kv_heads, head_dim)  # garbage where unused
    v_cache = torch.randn_like(k_cache)
    tables = []
    for k, v in seqs_kv:
        n = -(-k.shape[0] // block_size)
        table = [free.pop() for _ in range(n)]
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        write_kv(k_cache, v_cache, slots, k, v)
        tables.append(table)
    return k_cache, v_cache, tables


def _meta(parts_of_seqs, q_lens, q_positions, ctx_lens):
    """parts_of_seqs[s] = list of (logical index, physical id) this part holds for sequence s."""
    width = max([len(p) for p in parts_of_seqs] + [1])
    ids = torch.zeros(len(parts_of_seqs), width, dtype=torch.int64)
    idx = torch.zeros_like(ids)
    for s, p in enumerate(parts_of_seqs):
        for j, (i, b) in enumerate(p):
            ids[s, j], idx[s, j] = b, i
    return PartialAttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist())),
        query_positions=q_positions,
        block_ids=ids,
        block_indices=idx,
        num_blocks=torch.tensor([len(p) for p in parts_of_seqs]),
        context_lens=torch.tensor(ctx_lens),
    )


def _random_partition(n_blocks, num_parts, rng):
    """Random split points over the block indices, then shuffled assignment; parts may be empty."""
    cuts = sorted(rng.randint(0, n_blocks) for _ in range(num_parts - 1))
    bounds = [0, *cuts, n_blocks]
    parts = [list(range(bounds[i], bounds[i + 1])) for i in range(num_parts)]
    rng.shuffle(parts)
    return parts


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 5, 8])
def test_partial_attention_merge_equals_sdpa(num_heads, num_kv_heads, mode, num_parts):
    rng = random.Random(hash((num_heads, num_kv_heads, mode, num_parts)) % 1000)
    torch.manual_seed(rng.randint(0, 10**6))
    block_size, head_dim = 4, 16
    ctx_lens = [1, 3, 4, 5, 8, 9, 31]  # around block boundaries; 1 = single token
    seqs_kv = [(torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)) for n in ctx_lens]
    k_cache, v_cache, tables = _store(seqs_kv, block_size, num_kv_heads, head_dim, rng)
    q_lens = [1 if mode == "decode" else rng.randint(1, n) for n in ctx_lens]
    q_positions = torch.cat([torch.arange(n - ql, n) for n, ql in zip(ctx_lens, q_lens, strict=True)])
    q = torch.randn(int(sum(q_lens)), num_heads, head_dim)

    splits = [_random_partition(len(t), num_parts, rng) for t in tables]
    outs, lses = [], []
    for p in range(num_parts):
        held = [[(i, tables[s][i]) for i in splits[s][p]] for s in range(len(ctx_lens))]
        for h in held:
            rng.shuffle(h)  # a part's blocks need not be in logical order
        o, lse = partial_attention(q, k_cache, v_cache, _meta(held, q_lens, q_positions, ctx_lens))
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        outs.append(o)
        lses.append(lse)
    out, lse = merge_partials(outs, lses)

    row = 0
    for s, (k, v) in enumerate(seqs_kv):
        ref = _sdpa(q[row : row + q_lens[s]], k, v, q_positions[row : row + q_lens[s]])
        torch.testing.assert_close(out[row : row + q_lens[s]], ref, atol=TOL, rtol=0)
        row += q_lens[s]
    assert torch.isfinite(lse).all()


def test_empty_part_has_zero_output_and_minus_inf_lse():
    q = torch.randn(2, 2, 8)
    k_cache = torch.randn(4, 4, 2, 8)
    meta = _meta([[], []], [1, 1], torch.tensor([3, 0]), [4, 1])
    out, lse = partial_attention(q, k_cache, k_cache.clone(), meta)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))


def test_merge_ignores_empty_parts_even_with_nan_outputs():
    o = torch.randn(3, 2, 8)
    lse = torch.randn(3, 2)
    nan_part = torch.full_like(o, float("nan"))
    out, merged = merge_partials([nan_part, o], [torch.full_like(lse, -math.inf), lse])
    assert torch.equal(out, o)
    torch.testing.assert_close(merged, lse, atol=0, rtol=0)


def test_merge_of_all_empty_parts_is_zero_and_minus_inf():
    out, lse = merge_partials([torch.ones(2, 1, 4)] * 3, [torch.full((2, 1), -math.inf)] * 3)
    assert torch.equal(out, torch.zeros(2, 1, 4)) and bool(torch.isneginf(lse).all())


def test_merge_is_associative():
    torch.manual_seed(0)
    outs = [torch.randn(5, 3, 8) for _ in range(4)]
    lses = [torch.randn(5, 3) * 3 for _ in range(4)]
    flat = merge_partials(outs, lses)
    left = merge_partials(outs[:2], lses[:2])
    right = merge_partials(outs[2:], lses[2:])
    nested = merge_partials([left[0], right[0]], [left[1], right[1]])
    torch.testing.assert_close(nested[0], flat[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(nested[1], flat[1], atol=1e-6, rtol=0)


def test_bf16_inputs_computed_in_fp32():
    torch.manual_seed(1)
    k = torch.randn(6, 2, 16)
    v = torch.randn(6, 2, 16)
    k_cache = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k_cache, v_cache, torch.arange(6), k, v)
    q = torch.randn(1, 4, 16)
    meta = _meta([[(0, 0), (1, 1)]], [1], torch.tensor([5]), [6])
    out, lse = partial_attention(q.bfloat16(), k_cache, v_cache, meta)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = _sdpa(q, k_cache.float().flatten(0, 1)[:6], v_cache.float().flatten(0, 1)[:6], torch.tensor([5]))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_long_decode_goes_chunk_by_chunk_and_equals_sdpa(num_heads, num_kv_heads, monkeypatch):
    """Contexts above LONG_DECODE_BLOCKS rBlocks take the chunked path; it must equal SDPA exactly too.

    The thresholds are lowered so small shapes cross them (and a chunk boundary falls mid-context)."""
    from infinite_llm.core import attention

    monkeypatch.setattr(attention, "LONG_DECODE_BLOCKS", 8)
    monkeypatch.setattr(attention, "CHUNK_BLOCKS", 3)
    calls = []
    real = attention._decode_chunked
    monkeypatch.setattr(attention, "_decode_chunked", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(7)
    torch.manual_seed(7)
    block_size, head_dim = 4, 16
    ctx_lens = [150, 5, 1, 77]
    seqs_kv = [(torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)) for n in ctx_lens]
    k_cache, v_cache, tables = _store(seqs_kv, block_size, num_kv_heads, head_dim, rng)
    q_positions = torch.tensor([n - 1 for n in ctx_lens])
    q = torch.randn(len(ctx_lens), num_heads, head_dim)
    halves = [_random_partition(len(t), 2, rng) for t in tables]  # two holders, scattered blocks
    outs, lses = [], []
    for p in range(2):
        held = [[(i, tables[s][i]) for i in halves[s][p]] for s in range(len(ctx_lens))]
        meta = _meta(held, [1] * len(ctx_lens), q_positions, ctx_lens)
        o, lse = partial_attention(q, k_cache, v_cache, meta)
        outs.append(o)
        lses.append(lse)
    out, _ = merge_partials(outs, lses)
    assert len(calls) == 2  # both holders had a sequence over the threshold
    for s, (k, v) in enumerate(seqs_kv):
        torch.testing.assert_close(out[s : s + 1], _sdpa(q[s : s + 1], k, v, q_positions[s : s + 1]), atol=TOL, rtol=0)
