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
    assert len(meta.cache) == 1
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
