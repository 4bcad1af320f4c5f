"""The launch policy of the paged-attention kernel (launch_plan.py), as exact tile sizes and split counts."""

from __future__ import annotations

import pytest

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels.launch_plan import AttentionShape, LaunchPlan, TileOverrides, plan_launch

H200_SMS = 132


def llama(batch: int, context: int, query_len: int = 1, elem_bytes: int = 2, **changes: int) -> AttentionShape:
    """32 query / 8 kv heads x 128 (Llama-3-8B attention), block_size 16."""
    fields = dict(num_seqs=batch, max_query_len=query_len, max_blocks=context // 16, num_kv_heads=8, group=4,
                  head_dim=128, block_size=16, elem_bytes=elem_bytes)  # fmt: skip
    return AttentionShape(**{**fields, **changes})


def test_decode_of_one_long_sequence_spreads_over_every_sm():
    # 8 programs without splits; 2 per SM wants 33 splits, aligned to whole 128-key iterations: 32 x 1024 keys
    assert plan_launch(llama(1, 32768), H200_SMS) == LaunchPlan(
        block_m=16,
        block_n=128,
        num_q_tiles=1,
        num_splits=32,
        blocks_per_split=64,
        split_align=8,
        num_warps=4,
        num_stages=3,
    )


def test_decode_of_sixteen_sequences_splits_three_ways():
    plan = plan_launch(llama(16, 32768), H200_SMS)
    assert (plan.num_splits, plan.blocks_per_split, plan.block_n) == (3, 688, 128)
    assert plan.blocks_per_split % (plan.block_n // 16) == 0


def test_a_batch_that_fills_the_gpu_is_not_split():
    assert plan_launch(llama(128, 4096), H200_SMS).num_splits == 1


def test_short_contexts_keep_at_least_256_keys_per_split():
    plan = plan_launch(llama(1, 1024), H200_SMS)
    assert plan.num_splits == 4 and plan.blocks_per_split * 16 == 256


def test_bf16_prefill_chunk_takes_128_row_tiles_with_8_warps():
    # 512 tokens x group 4 = 2048 rows: 16 tiles of 32 tokens, each re-reading the context (was 32 tiles)
    plan = plan_launch(llama(1, 32768, query_len=512), H200_SMS)
    assert (plan.block_m, plan.block_n, plan.num_q_tiles, plan.num_warps, plan.num_splits) == (128, 64, 16, 8, 3)


def test_fp32_keeps_64_row_tiles_and_32_key_iterations():
    plan = plan_launch(llama(1, 32768, query_len=512, elem_bytes=4), H200_SMS)
    assert (plan.block_m, plan.block_n, plan.num_warps) == (64, 32, 4)
    assert plan_launch(llama(1, 32768, elem_bytes=4), H200_SMS).block_n == 64  # decode: 64 KB tiles


def test_smaller_heads_take_more_keys_per_iteration():
    assert plan_launch(llama(1, 4096, head_dim=64), H200_SMS).block_n == 128
    assert plan_launch(llama(1, 4096, query_len=512, head_dim=64), H200_SMS).block_n == 64


def test_a_tile_holds_a_whole_gqa_group_and_a_whole_block():
    assert plan_launch(llama(1, 4096, group=32), H200_SMS).block_m == 32
    assert plan_launch(llama(1, 4096, block_size=128, max_blocks=32), H200_SMS).block_n == 128


def test_no_splits_without_a_gpu():
    assert plan_launch(llama(1, 32768), num_sms=0).num_splits == 1


def test_forced_splits_are_kept_unless_a_split_would_be_empty():
    forced = plan_launch(llama(1, 1024), H200_SMS, TileOverrides(num_splits=7))
    assert (forced.num_splits, forced.blocks_per_split) == (7, 10)  # not aligned to iterations
    assert plan_launch(llama(1, 64), H200_SMS, TileOverrides(num_splits=9)).num_splits == 4


@pytest.mark.parametrize(
    "forced,message",
    [
        (TileOverrides(block_m=8), "block_m must be a power of two >= 16"),
        (TileOverrides(block_m=48), "block_m must be a power of two >= 16"),
        (TileOverrides(block_n=8), "block_n must be a power of two >= 16"),
        (TileOverrides(num_splits=0), "num_splits must be >= 1"),
    ],
)
def test_forced_values_the_kernel_cannot_run_are_refused(forced, message):
    with pytest.raises(InvalidRequest, match=message):
        plan_launch(llama(1, 4096), H200_SMS, forced)


def test_forced_tiles_smaller_than_a_group_or_a_block_are_refused():
    with pytest.raises(InvalidRequest, match="block_m must be a power of two >= 32"):
        plan_launch(llama(1, 4096, group=32), H200_SMS, TileOverrides(block_m=16))
    with pytest.raises(InvalidRequest, match="block_n must be a power of two >= 32"):
        plan_launch(llama(1, 4096, block_size=32, max_blocks=128), H200_SMS, TileOverrides(block_n=16))
