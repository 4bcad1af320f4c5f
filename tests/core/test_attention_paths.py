"""The CPU flash-attention kernel behind partial_attention equals the textbook softmax, and its plumbing is exact.

partial_attention on CPU calls torch's ``_scaled_dot_product_flash_attention_for_cpu`` (a private op that
returns lse); other devices without Triton use ``_softmax_lse``. Both must agree, with masks, causal flags,
GQA via stride-0 expand, and the per-step cache on the metadata reused across layers.
"""

import math

import pytest
import torch

from infinite_llm.core import attention
from infinite_llm.core.attention import PartialAttentionMetadata, partial_attention


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_kernel_equals_textbook_softmax_and_its_lse_is_natural_log(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 16)  # (B, H, T, D)
    k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    visible = torch.rand(2, 1, 5, 5) > 0.3
    visible[..., 0] = True  # every row sees a key (empty rows are the caller's to fix)
    mask = None if causal else attention._additive(visible)
    out, lse = attention._attention_lse(q, k, v, mask, causal, 0.25)
    ref_out, ref_lse = attention._softmax_lse(q, k, v, mask, causal, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


def _pool_meta(q_len, ctx_len, block_size=4, num_kv_heads=2, head_dim=8):
    """One sequence, its rBlocks scattered in reverse over a pool; queries are its last ``q_len`` tokens."""
    n = -(-ctx_len // block_size)
    k_cache = torch.randn(n + 2, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    meta = PartialAttentionMetadata(
        query_start_loc=torch.tensor([0, q_len]),
        query_positions=torch.arange(ctx_len - q_len, ctx_len),
        block_ids=torch.arange(n + 1, 1, -1)[None, :],
        block_indices=torch.arange(n)[None, :],
        num_blocks=torch.tensor([n]),
        context_lens=torch.tensor([ctx_len]),
    )
    return k_cache, v_cache, meta


@pytest.mark.parametrize("q_len,ctx_len", [(1, 9), (9, 9), (5, 11)])  # decode, whole prompt (causal), chunk
def test_cpu_kernel_path_equals_textbook_path(q_len, ctx_len, monkeypatch):
    torch.manual_seed(q_len)
    k_cache, v_cache, meta = _pool_meta(q_len, ctx_len)
    q = torch.randn(q_len, 6, 8)
    out, lse = partial_attention(q, k_cache, v_cache, meta)
    monkeypatch.setattr(attention, "_attention_lse", attention._softmax_lse)
    ref_out, ref_lse = partial_attention(q, k_cache, v_cache, meta)  # the cached key plan is reused
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


def test_cache_on_metadata_serves_every_layer_without_changing_results():
    torch.manual_seed(3)
    k_cache, v_cache, meta = _pool_meta(5, 11)
    q = torch.randn(5, 6, 8)
    first = partial_attention(q, k_cache, v_cache, meta)
    assert set(meta.cache) == {"kind", ("prefill", k_cache.shape[1])} and meta.cache["kind"] == "prefill"
    fresh = PartialAttentionMetadata(**{f: getattr(meta, f) for f in meta.__dataclass_fields__ if f != "cache"})
    assert fresh == meta  # the cache is not part of the metadata's value
    for a, b in zip(first, partial_attention(q, k_cache, v_cache, fresh), strict=True):
        assert torch.equal(a, b)


def test_queries_before_every_key_of_a_part_get_zero_and_minus_inf():
    """A part holding only later rBlocks: early queries of a prefill chunk see none of its keys."""
    torch.manual_seed(4)
    k_cache = torch.randn(3, 4, 1, 8)
    meta = PartialAttentionMetadata(
        query_start_loc=torch.tensor([0, 6]),
        query_positions=torch.arange(2, 8),
        block_ids=torch.tensor([[2]]),
        block_indices=torch.tensor([[1]]),  # tokens 4..7
        num_blocks=torch.tensor([1]),
        context_lens=torch.tensor([8]),
    )
    out, lse = partial_attention(torch.randn(6, 2, 8), k_cache, k_cache.clone(), meta)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and bool(torch.isneginf(lse[:2]).all())
    assert torch.isfinite(lse[2:]).all() and not math.isnan(float(out.sum()))


def test_a_prefill_chunk_reads_earlier_chunks_unmasked_and_its_own_tokens_causally():
    """Chunk of positions 6..10 over 11 keys: keys 0..5 need no mask, keys 6..10 are a causal square."""
    _, _, meta = _pool_meta(5, 11)
    (keys,) = attention._prefill_keys(meta, 4)
    assert (keys.prefix_slots.numel(), keys.slots.numel(), keys.causal, keys.mask) == (6, 5, True, None)


def _prompt_pool(ctx_len, block_size=4, num_kv_heads=2, head_dim=8):
    """K/V of a ``ctx_len``-token prompt in rBlocks allocated in order (ids 1, 2, ...: consecutive slots)."""
    n = -(-ctx_len // block_size)
    k_cache = torch.randn(n + 2, block_size, num_kv_heads, head_dim)
    return k_cache, torch.randn_like(k_cache), torch.arange(1, n + 1)


def _chunk_meta(block_ids, lo, hi, block_size=4):
    """Queries at positions ``lo..hi-1`` of one sequence whose first ``hi`` tokens have KV."""
    n = -(-hi // block_size)
    return PartialAttentionMetadata(
        query_start_loc=torch.tensor([0, hi - lo]),
        query_positions=torch.arange(lo, hi),
        block_ids=block_ids[None, :n],
        block_indices=torch.arange(n)[None, :],
        num_blocks=torch.tensor([n]),
        context_lens=torch.tensor([hi]),
    )


@pytest.mark.parametrize("chunk", [5, 8])  # chunk boundaries off and on the rBlock boundaries (block_size 4)
@pytest.mark.parametrize("prompt_len", [7, 8, 9, 15, 16, 17])
def test_chunked_prefill_equals_the_single_pass_around_block_and_chunk_boundaries(prompt_len, chunk):
    torch.manual_seed(prompt_len * 10 + chunk)
    k_cache, v_cache, block_ids = _prompt_pool(prompt_len)
    q = torch.randn(prompt_len, 6, 8)
    whole_out, whole_lse = partial_attention(q, k_cache, v_cache, _chunk_meta(block_ids, 0, prompt_len))
    for lo in range(0, prompt_len, chunk):
        hi = min(lo + chunk, prompt_len)
        out, lse = partial_attention(q[lo:hi], k_cache, v_cache, _chunk_meta(block_ids, lo, hi))
        torch.testing.assert_close(out, whole_out[lo:hi], atol=1e-5, rtol=0)
        torch.testing.assert_close(lse, whole_lse[lo:hi], atol=1e-5, rtol=0)


def test_consecutive_slots_are_read_as_a_view_with_the_result_of_the_gather(monkeypatch):
    torch.manual_seed(5)
    k_cache, v_cache, block_ids = _prompt_pool(11)
    q = torch.randn(5, 6, 8)
    meta = _chunk_meta(block_ids, 6, 11)
    (keys,) = attention._prefill_keys(meta, 4)
    assert (keys.prefix_slots, keys.slots) == (slice(4, 10), slice(10, 15))  # block 1 starts at slot 4
    out, lse = partial_attention(q, k_cache, v_cache, meta)
    monkeypatch.setattr(attention, "_as_range", lambda slots: slots)  # always gather
    ref_out, ref_lse = partial_attention(q, k_cache, v_cache, _chunk_meta(block_ids, 6, 11))
    assert isinstance(attention._prefill_keys(_chunk_meta(block_ids, 6, 11), 4)[0].slots, torch.Tensor)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


def test_slots_with_a_gap_are_gathered():
    assert attention._as_range(torch.tensor([4, 5, 6])) == slice(4, 7)
    assert isinstance(attention._as_range(torch.tensor([4, 5, 8])), torch.Tensor)
    assert isinstance(attention._as_range(torch.tensor([6, 5, 4])), torch.Tensor)


def test_prefix_with_query_heads_on_the_query_axis_equals_the_per_head_call():
    torch.manual_seed(6)
    k_cache, v_cache, _ = _prompt_pool(12)
    q, slots = torch.randn(7, 6, 8), torch.tensor([9, 2, 3, 4, 11, 12])
    out, lse = attention._attention_over_prefix(q, k_cache, v_cache, slots, 0.3)
    ref_out, ref_lse = attention._attention_over(q, k_cache, v_cache, slots, None, False, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


def test_two_part_merge_equals_the_general_merge_with_empty_rows_in_the_second_part():
    torch.manual_seed(7)
    a = (torch.randn(5, 4, 8), torch.randn(5, 4))
    b_out, b_lse = torch.randn(5, 4, 8), torch.randn(5, 4)
    b_out[:2], b_lse[:2] = 0.0, -math.inf  # queries that see none of the chunk's own keys
    out, lse = attention._merge_two(a, (b_out, b_lse))
    ref_out, ref_lse = attention.merge_partials([a[0], b_out], [a[1], b_lse])
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:2], a[0][:2], atol=1e-6, rtol=0)
