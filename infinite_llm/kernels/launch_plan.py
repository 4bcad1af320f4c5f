"""Launch shape of the paged-attention kernel (``paged_attention.py``): tiles, warps and KV splits.

Pure arithmetic on a few scalars, so the policy is testable without a GPU. The kernel reads K and V through
a block list, so decode is bound by HBM bandwidth, and the choices below follow from Little's law
(bytes in flight = bandwidth x latency; H200: ~4.3 TB/s x ~1 us = ~4 MB chip-wide, ~33 KB per SM):

* ``block_n`` (keys per loop iteration) is sized so one iteration loads ``KV_TILE_BYTES`` of K + V (64 keys
  at head_dim 128 in bf16), ``FEW_ROWS_KV_TILE_BYTES`` when a program has few query rows (decode: 128
  keys). Each iteration waits on two dependent loads (block ids, then K/V); a bigger tile puts more bytes
  behind each wait and cuts the per-iteration work (reductions, ids gather, loop overhead) per byte.
* ``num_splits`` (flash-decoding, Dao et al. 2023) spreads one long sequence over ``PROGRAMS_PER_SM`` x SMs
  programs when the batch alone would leave SMs idle: batch 1 x 8 kv heads is 8 programs for 132 SMs,
  so without splits 124 SMs idle. Each split keeps >= ``MIN_KEYS_PER_SPLIT`` keys, which bounds the fp32
  partials the merge reads to a few percent of the KV bytes.
* ``block_m`` (query rows per program) is 128 for 16-bit prefill chunks: every query tile re-reads the
  whole context, so 128 rows (32 tokens at GQA group 4) read it half as often as 64 rows, and a
  128-row tile is the tensor-core shape FlashAttention-2 uses. The cost: an accumulator of 128 x head_dim
  fp32 needs 8 warps (64 registers per thread at head_dim 128), a chunk shorter than the tile computes
  padding rows, and fewer programs per chunk (the splits make up for it). fp32 and head_dim > 128 keep
  64 rows, whose register and shared-memory footprints are known to fit.

Measured on an H200 (``benchmarks/kernels_gpu.py`` sweeps, 32 query / 8 KV heads x 128, bf16, 2026-12-04):
decode of batch 1 x 32K read K/V at 0.55 of 4.3 TB/s with the former policy (64-key tiles, 4 programs per
SM: 64 splits), 0.61 with 33 splits, 0.71 with 33 splits of 128-key tiles; more splits lost (132: 0.50,
264: 0.40): the merge grows and each program's work shrinks to a few tiles. Batch 16 x 32K: 0.83 with 5
splits, 0.94 with 3. Hence 2 programs per SM and 128-key decode tiles; this policy then read batch 1 x 32K
at 0.77 and batch 16 x 32K at 0.83. In that run a 2-stage pipeline read batch 16 x 32K at 0.99 and batch 1
at 0.74: the stage count is the next question (README "On GPUs").
"""

from __future__ import annotations

from dataclasses import dataclass

from infinite_llm.core.errors import InvalidRequest

KV_TILE_BYTES = 32 * 1024  # K + V bytes one program loads per iteration
FEW_ROWS_KV_TILE_BYTES = 64 * 1024  # the same for programs of <= FEW_ROWS query rows (decode)
FEW_ROWS = 32
MAX_BLOCK_N = 128  # few query rows: a 16 x 128 score tile is small
MAX_BLOCK_N_WIDE = 64  # >= 64 query rows: a 128 x 64 fp32 score tile is 32 registers per thread at 8 warps
WIDE_BLOCK_M = 128  # 16-bit prefill tile rows
NARROW_BLOCK_M = 64  # fp32 or head_dim > 128
MIN_ROWS = 16  # smallest tl.dot
PROGRAMS_PER_SM = 2  # the H200 sweep above: 4 (a second wave of smaller splits, a larger merge) lost
MIN_KEYS_PER_SPLIT = 256
NUM_STAGES = 3  # Triton's software pipeline depth for the K/V loads (its default, said once here)


@dataclass(frozen=True)
class AttentionShape:
    """The scalars of one call that the launch shape depends on."""

    num_seqs: int
    max_query_len: int  # query tokens of the longest sequence of the call
    max_blocks: int  # width of ``block_ids``
    num_kv_heads: int
    group: int  # query heads per kv head
    head_dim: int
    block_size: int  # tokens per rBlock, a power of two
    elem_bytes: int  # of query / K / V: 4 fp32, 2 fp16 or bf16


@dataclass(frozen=True)
class TileOverrides:
    """Values forced by the caller (tests, tuning sweeps); ``None`` takes the policy above."""

    num_splits: int | None = None
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """Grid ``(num_seqs, num_q_tiles, num_kv_heads * num_splits)`` and tile sizes of one launch."""

    block_m: int  # rows per program: (query tokens per tile) * group
    block_n: int  # keys per loop iteration, a whole number of blocks
    num_q_tiles: int
    num_splits: int
    blocks_per_split: int  # of the widest sequence (``max_blocks``); the kernel divides each one's own
    split_align: int  # blocks: each sequence's split is a multiple (1 when num_splits was forced)
    num_warps: int
    num_stages: int


def plan_launch(shape: AttentionShape, num_sms: int, forced: TileOverrides = TileOverrides()) -> LaunchPlan:
    """Launch shape for ``shape`` on a GPU of ``num_sms`` SMs (0: no GPU, never split).

    Raises:
        InvalidRequest: a forced value the kernel cannot run (not a power of two, too small, < 1 split).
    """
    block_m = forced.block_m or _block_m(shape)
    _check_pow2("block_m", block_m, max(MIN_ROWS, _next_pow2(shape.group)))
    block_n = forced.block_n or _block_n(shape, block_m)
    _check_pow2("block_n", block_n, max(MIN_ROWS, shape.block_size))
    num_q_tiles = _cdiv(shape.max_query_len, block_m // shape.group)
    blocks_per_iter = block_n // shape.block_size
    if forced.num_splits is None:
        programs = shape.num_seqs * num_q_tiles * shape.num_kv_heads
        num_splits, align = _num_splits(programs, shape.max_blocks * shape.block_size, num_sms), blocks_per_iter
    else:
        num_splits, align = forced.num_splits, 1  # as asked: only splits left without blocks are dropped
    if num_splits < 1:
        raise InvalidRequest(f"num_splits must be >= 1, got {num_splits}")
    # Whole iterations per split (the heuristic's), so no split ends in a half-masked tile.
    blocks_per_split = max(align, _round_up(_cdiv(shape.max_blocks, num_splits), align))
    num_splits = max(1, _cdiv(shape.max_blocks, blocks_per_split))
    num_warps = forced.num_warps or (8 if block_m >= WIDE_BLOCK_M else 4)
    num_stages = forced.num_stages or NUM_STAGES
    return LaunchPlan(block_m, block_n, num_q_tiles, num_splits, blocks_per_split, align, num_warps, num_stages)


def _block_m(shape: AttentionShape) -> int:
    """All rows of the longest query run, between 16 and the tile cap; never less than one GQA group."""
    wide = shape.elem_bytes <= 2 and shape.head_dim <= 128
    cap = max(WIDE_BLOCK_M if wide else NARROW_BLOCK_M, _next_pow2(shape.group))
    return min(max(MIN_ROWS, _next_pow2(shape.group * shape.max_query_len)), cap)


def _block_n(shape: AttentionShape, block_m: int) -> int:
    """Keys whose K + V fill ``KV_TILE_BYTES`` (``FEW_ROWS_KV_TILE_BYTES`` for few query rows), capped by the
    score tile's registers; >= one block."""
    key_bytes = 2 * _next_pow2(shape.head_dim) * shape.elem_bytes  # K and V of one key, padded head_dim
    tile_bytes = FEW_ROWS_KV_TILE_BYTES if block_m <= FEW_ROWS else KV_TILE_BYTES
    fit = _prev_pow2(max(1, tile_bytes // key_bytes))
    cap = MAX_BLOCK_N if block_m <= FEW_ROWS else MAX_BLOCK_N_WIDE
    return max(MIN_ROWS, shape.block_size, min(fit, cap))


def _num_splits(programs: int, max_keys: int, num_sms: int) -> int:
    """Splits that bring the grid to ``PROGRAMS_PER_SM`` per SM, keeping ``MIN_KEYS_PER_SPLIT`` keys each."""
    if num_sms <= 0 or programs <= 0:
        return 1
    wanted = _cdiv(PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, max_keys // MIN_KEYS_PER_SPLIT))


def _check_pow2(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise InvalidRequest(f"{name} must be a power of two >= {least}, got {value}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)
