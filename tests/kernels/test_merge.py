"""Triton merge of partial results (interpreted) against core/attention.py ``merge_partials``."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from infinite_llm.core.attention import PartialAttentionMetadata, merge_partials, partial_attention
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels import merge
from infinite_llm.kernels.merge import triton_merge_partials
from infinite_llm.kernels.paged_attention import triton_partial_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}
NEG_INF = float("-inf")


def random_parts(num_parts: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``outs [P, 5, 3, 16]``, ``lses [P, 5, 3]``; some parts empty (lse -inf, NaN out), row (0, 0) all."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(num_parts, 5, 3, 16, generator=gen)
    lses = torch.randn(num_parts, 5, 3, generator=gen) * 4
    empty = torch.rand(num_parts, 5, 3, generator=gen) < 0.3
    empty[:, 0, 0] = True
    lses[empty] = NEG_INF
    outs[empty] = float("nan")  # an empty part's output is garbage and must never be read
    return outs, lses


def test_kernel_runs_in_the_interpreter():
    assert isinstance(merge._merge_kernel, InterpretedFunction)


@pytest.mark.parametrize("num_parts", [1, 3, 33, 70])  # 33: one pass (a split-KV decode); 70 > 64: two passes
def test_matches_reference(num_parts):
    outs, lses = random_parts(num_parts, seed=num_parts)
    out, lse = triton_merge_partials(outs, lses)
    ref_out, ref_lse = merge_partials(outs, lses)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_all_empty_row_is_zero_with_neg_inf_lse():
    outs, lses = random_parts(3)
    out, lse = triton_merge_partials(outs, lses)
    assert torch.equal(out[0, 0], torch.zeros(16)) and lse[0, 0] == NEG_INF
    assert not out.isnan().any()


def test_accepts_a_list_of_parts_and_keeps_their_dtype():
    outs, lses = random_parts(2)
    outs = torch.nan_to_num(outs).bfloat16()
    out, lse = triton_merge_partials(list(outs), list(lses))
    ref_out, ref_lse = merge_partials(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_merging_two_holders_equals_attention_over_all_blocks():
    """DistAttention end to end: blocks {0, 2} on one holder, {1, 3} on another, merged = all four."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 8, 4, 2, 16, generator=gen)  # [num_pool_blocks, block_size, Hkv, D]
    query = torch.randn(3, 4, 16, generator=gen)  # a chunk at positions 12..14 of a 15-token context

    def meta(block_ids: list[int], block_indices: list[int]) -> PartialAttentionMetadata:
        return PartialAttentionMetadata(
            torch.tensor([0, 3]), torch.tensor([12, 13, 14]), torch.tensor([block_ids]),
            torch.tensor([block_indices]), torch.tensor([len(block_ids)]), torch.tensor([15]),
        )  # fmt: skip

    first = triton_partial_attention(query, k_cache, v_cache, meta([5, 1], [0, 2]))
    second = triton_partial_attention(query, k_cache, v_cache, meta([7, 2], [3, 1]))
    out, lse = triton_merge_partials(torch.stack([first[0], second[0]]), torch.stack([first[1], second[1]]))
    ref_out, ref_lse = partial_attention(query, k_cache, v_cache, meta([5, 2, 1, 7], [0, 1, 2, 3]))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


@pytest.mark.parametrize(
    "outs,lses,message",
    [
        (torch.zeros(0, 2, 3, 4), torch.zeros(0, 2, 3), "at least one part"),
        ([], [], "at least one part"),
        (torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 4), "lses has shape"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3), "expected \\[P, T, H, D\\]"),
        (torch.zeros(2, 2, 3, 4, dtype=torch.int32), torch.zeros(2, 2, 3), "partial_outs has dtype"),
    ],
)
def test_rejects_bad_inputs(outs, lses, message):
    with pytest.raises(InvalidRequest, match=message):
        triton_merge_partials(outs, lses)
