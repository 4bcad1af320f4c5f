"""Triton paged partial attention (interpreted, fp32) against the torch reference in core/attention.py."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from infinite_llm.core.attention import PartialAttentionMetadata, partial_attention
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels import launch_plan, paged_attention
from infinite_llm.kernels.launch_plan import TileOverrides
from infinite_llm.kernels.paged_attention import triton_partial_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}
PADDING_ID = 10**6  # out of every pool here: a padding entry that was read would fault


@dataclass(frozen=True)
class Part:
    """One sequence's share of a part: its context, its query positions, the logical blocks the part holds."""

    context_len: int
    query_positions: list[int]
    blocks: list[int]


@dataclass(frozen=True)
class Case:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_pool_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: PartialAttentionMetadata


def build_case(
    parts: list[Part],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """Random query/KV; the listed blocks land on shuffled physical ids, rows padded by one PADDING_ID."""
    gen = torch.Generator().manual_seed(seed)
    num_pool_blocks = sum(len(p.blocks) for p in parts) + 3  # a few blocks nobody lists
    physical = iter(torch.randperm(num_pool_blocks, generator=gen).tolist())
    width = max((len(p.blocks) for p in parts), default=0) + 1
    block_ids = [[next(physical) for _ in p.blocks] + [PADDING_ID] * (width - len(p.blocks)) for p in parts]
    block_indices = [p.blocks + [0] * (width - len(p.blocks)) for p in parts]
    lens = [len(p.query_positions) for p in parts]
    num_tokens = sum(lens)
    meta = PartialAttentionMetadata(
        query_start_loc=torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(parts))]),
        query_positions=torch.tensor([pos for p in parts for pos in p.query_positions], dtype=torch.int64),
        block_ids=torch.tensor(block_ids, dtype=torch.int64).view(len(parts), width),
        block_indices=torch.tensor(block_indices, dtype=torch.int64).view(len(parts), width),
        num_blocks=torch.tensor([len(p.blocks) for p in parts], dtype=torch.int64),
        context_lens=torch.tensor([p.context_len for p in parts], dtype=torch.int64),
    )
    kv_shape = (num_pool_blocks, block_size, num_kv_heads, head_dim)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(kv_shape, generator=gen).to(dtype)
    v_cache = torch.randn(kv_shape, generator=gen).to(dtype)
    return Case(query, k_cache, v_cache, meta)


def shuffled(blocks: list[int], seed: int = 1) -> list[int]:
    out = list(blocks)
    random.Random(seed).shuffle(out)
    return out


def decode_batch(block_size: int) -> list[Part]:
    """Four sequences of different lengths, one query each at the last position."""
    nb = lambda ctx: math.ceil(ctx / block_size)  # blocks of a context
    return [
        Part(13, [12], list(reversed(range(nb(13))))),  # every block, listed backwards
        Part(1, [0], [0]),  # a one-token sequence
        Part(29, [28], shuffled(list(range(0, nb(29), 2)))),  # every other block, unsorted
        Part(6, [5], []),  # this holder has none of its blocks
    ]


def prefill_batch(block_size: int) -> list[Part]:
    """Causal chunks in the middle of their contexts, crossing block boundaries, mixed with a decode."""
    nb = lambda ctx: math.ceil(ctx / block_size)
    return [
        Part(21, list(range(9, 21)), shuffled(list(range(nb(21))))),
        Part(11, list(range(5, 11)), [nb(11) - 1, 0]),  # first and last blocks only
        Part(3, [0, 1, 2], [0]),  # a whole short prompt
        Part(9, [8], []),  # a decode whose blocks are all elsewhere
        Part(12, [2, 3], [8 // block_size]),  # only keys after the queries: nothing visible
    ]


def assert_matches_reference(case: Case, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta, **kwargs)
    scale = kwargs.get("scale")  # the reference needs no launch hints (num_splits, tiles, max_query_len)
    ref_out, ref_lse = partial_attention(case.query, case.k_cache, case.v_cache, case.meta, scale)
    assert out.dtype == case.query.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    return out, lse


def test_kernel_runs_in_the_interpreter():
    assert isinstance(paged_attention._paged_attention_kernel, InterpretedFunction)


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("batch", [decode_batch, prefill_batch])
def test_matches_reference_for_mha_gqa_mqa(batch, num_heads, num_kv_heads, block_size):
    case = build_case(batch(block_size), num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    assert_matches_reference(case)


def test_head_dim_32_and_custom_scale_match_reference():
    case = build_case(prefill_batch(8), head_dim=32, block_size=8, seed=3)
    assert_matches_reference(case, scale=0.3)


def test_rows_without_visible_keys_are_zero_with_neg_inf_lse():
    case = build_case(prefill_batch(4))
    out, lse = assert_matches_reference(case)
    # tokens of Part(9, [8], []) and Part(12, [2, 3], [block 2]): rows 21, 22, 23
    assert torch.equal(out[21:], torch.zeros_like(out[21:]))
    assert torch.isneginf(lse[21:]).all() and torch.isfinite(lse[:21]).all()


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_kv_splits_merge_to_the_single_pass_result(num_splits):
    parts = [Part(70, [69], shuffled(list(range(18)), seed=2)), Part(33, list(range(25, 33)), list(range(9)))]
    case = build_case(parts, block_size=4, seed=4)
    single, single_lse = triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta, num_splits=1)
    out, lse = assert_matches_reference(case, num_splits=num_splits)
    torch.testing.assert_close(out, single, **TOL)
    torch.testing.assert_close(lse, single_lse, **TOL)


def long_decode_batch() -> list[Part]:
    """Three decodes over 100 to 500 tokens in shuffled blocks of 4, one holding only every third block."""
    return [
        Part(500, [499], shuffled(list(range(125)), seed=5)),
        Part(230, [229], shuffled(list(range(0, 58, 3)), seed=6)),
        Part(101, [100], list(reversed(range(26)))),
    ]


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (5, 16), (3, 64), (13, 32), (2, 128)])
def test_long_decode_matches_reference_for_any_split_count_and_key_tile(num_splits, block_n):
    case = build_case(long_decode_batch(), num_heads=8, num_kv_heads=2, block_size=4, seed=7)
    assert_matches_reference(case, num_splits=num_splits, tiles=TileOverrides(block_n=block_n))


def widened(case: Case, width: int) -> Case:
    """The same case with block tables padded to ``width`` columns (a CUDA-graph bucket's fixed width)."""
    pad = width - case.meta.block_ids.shape[1]
    ids = torch.nn.functional.pad(case.meta.block_ids, (0, pad), value=PADDING_ID)
    idx = torch.nn.functional.pad(case.meta.block_indices, (0, pad))
    meta = PartialAttentionMetadata(
        case.meta.query_start_loc, case.meta.query_positions, ids, idx, case.meta.num_blocks, case.meta.context_lens
    )
    return Case(case.query, case.k_cache, case.v_cache, meta)


@pytest.mark.parametrize("num_splits", [None, 1, 6, 40])
def test_each_sequence_spreads_its_own_blocks_over_the_splits_of_a_wide_table(num_splits, monkeypatch):
    """Splits are sized per sequence (its num_blocks), not by the table width: a 500-block-wide table with
    sequences of 1 to 125 blocks, sized as a CUDA graph would capture it, with ``max_query_len`` given (the
    path without a host sync)."""
    monkeypatch.setattr(paged_attention, "_num_sms", lambda device: 132)
    monkeypatch.setattr(launch_plan, "MIN_KEYS_PER_SPLIT", 32)
    parts = long_decode_batch() + [Part(1, [0], [0]), Part(6, [5], [])]
    case = widened(build_case(parts, num_heads=8, num_kv_heads=2, block_size=4, seed=11), 500)
    assert_matches_reference(case, num_splits=num_splits, max_query_len=1)


def test_a_given_max_query_len_out_of_range_is_refused():
    case = build_case(decode_batch(4))
    with pytest.raises(InvalidRequest, match="max_query_len 0 must lie in"):
        triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta, max_query_len=0)


def long_prefill_batch() -> list[Part]:
    """A 40-token chunk at the end of 170 tokens in shuffled blocks of 4, and a short decode."""
    return [Part(170, list(range(130, 170)), shuffled(list(range(43)), seed=8)), Part(9, [8], [2, 0, 1])]


@pytest.mark.parametrize("block_m,block_n", [(128, 16), (128, 64), (32, 32)])
def test_prefill_chunk_in_wide_query_tiles_matches_reference(block_m, block_n):
    # 40 query tokens x group 4 = 160 rows: two tiles of 32 tokens at block_m 128, the second part-empty
    case = build_case(long_prefill_batch(), num_heads=8, num_kv_heads=2, block_size=4, seed=9)
    tiles = TileOverrides(block_m=block_m, block_n=block_n, num_warps=8)
    assert_matches_reference(case, num_splits=3, tiles=tiles)


@pytest.mark.parametrize("batch", [long_decode_batch, long_prefill_batch])
def test_default_h200_plan_matches_reference(batch, monkeypatch):
    """The splits the policy picks for 132 SMs (aligned to whole key tiles), run in the interpreter."""
    monkeypatch.setattr(paged_attention, "_num_sms", lambda device: 132)
    monkeypatch.setattr(launch_plan, "MIN_KEYS_PER_SPLIT", 32)  # split contexts this small too
    plans = []
    monkeypatch.setattr(
        paged_attention, "plan_launch", lambda *a: plans.append(launch_plan.plan_launch(*a)) or plans[-1]
    )
    case = build_case(batch(), num_heads=8, num_kv_heads=2, block_size=4, seed=10)
    assert_matches_reference(case)
    assert plans[0].num_splits > 1 and plans[0].blocks_per_split % (plans[0].block_n // 4) == 0


def test_launcher_rejects_forced_tiles_it_cannot_run():
    case = build_case([Part(5, [4], [0, 1])])
    with pytest.raises(InvalidRequest, match="block_n must be a power of two"):
        triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta, tiles=TileOverrides(block_n=48))


def test_stale_slots_past_the_context_are_never_read():
    # block 1 holds positions 4, 5 and two stale slots
    case = build_case([Part(6, [5], [1, 0])], block_size=4)
    tail_block = int(case.meta.block_ids[0, 0])
    case.k_cache[tail_block, 2:] = float("nan")
    case.v_cache[tail_block, 2:] = float("nan")
    out, lse = triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta)
    case.k_cache[tail_block, 2:] = 0.0
    case.v_cache[tail_block, 2:] = 0.0
    ref_out, ref_lse = partial_attention(case.query, case.k_cache, case.v_cache, case.meta)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_bf16_inputs_give_bf16_output_close_to_reference():
    case = build_case(prefill_batch(4), dtype=torch.bfloat16)
    out, lse = triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta)
    ref_out, ref_lse = partial_attention(case.query, case.k_cache, case.v_cache, case.meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_empty_batch_returns_empty_results():
    case = build_case([Part(5, [], [0, 1])])
    out, lse = triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


def _with(case: Case, **changes: object) -> Case:
    fields = {"query": case.query, "k_cache": case.k_cache, "v_cache": case.v_cache, "meta": case.meta}
    return Case(**{**fields, **changes})


def _meta_with(case: Case, **changes: torch.Tensor) -> Case:
    return _with(case, meta=PartialAttentionMetadata(**{**case.meta.__dict__, **changes}))


BAD_INPUTS = {
    "integer query": (lambda c: _with(c, query=c.query.long()), "query has dtype torch.int64"),
    "kv dtype differs": (lambda c: _with(c, k_cache=c.k_cache.half()), "k_cache has dtype torch.float16"),
    "heads not a multiple": (lambda c: _with(c, query=c.query[:, :3]), "num_heads 3 is not a multiple"),
    "head_dim differs": (
        lambda c: _with(c, query=c.query[..., :8]),
        "k_cache head_dim 16 != query head_dim 8",
    ),
    "v shape differs": (lambda c: _with(c, v_cache=c.v_cache[:, :2]), "v_cache has shape"),
    "block_size not 2^n": (
        lambda c: _with(c, k_cache=c.k_cache[:, :3], v_cache=c.v_cache[:, :3]),
        "block_size 3 must be a power of two",
    ),
    "float metadata": (
        lambda c: _meta_with(c, num_blocks=c.meta.num_blocks.float()),
        "meta.num_blocks has dtype",
    ),
    "positions short": (
        lambda c: _meta_with(c, query_positions=c.meta.query_positions[:-1]),
        "meta.query_positions has shape",
    ),
    "starts do not end at num_tokens": (
        lambda c: _meta_with(c, query_start_loc=torch.tensor([0, 1, 2])),
        "query_start_loc must rise from 0 to 4",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_launcher_rejects_bad_inputs_before_launch(name):
    make_bad, message = BAD_INPUTS[name]
    bad = make_bad(build_case([Part(13, [11, 12], [0, 2]), Part(5, [3, 4], [1])]))
    with pytest.raises(InvalidRequest, match=message):
        triton_partial_attention(bad.query, bad.k_cache, bad.v_cache, bad.meta)


def test_launcher_rejects_zero_splits():
    case = build_case([Part(5, [4], [0, 1])])
    with pytest.raises(InvalidRequest, match="num_splits must be >= 1"):
        triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta, num_splits=0)
