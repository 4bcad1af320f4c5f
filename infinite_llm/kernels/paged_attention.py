"""Triton paged partial attention: one MicroAttention over the rBlocks a holder lists -> ``(out, lse)``.

Torch reference: :func:`infinite_llm.core.attention.partial_attention` (same signature, masks and edge cases).
The kernel is FlashAttention-2's online softmax (Dao 2023, Alg. 1, in base 2) over a paged KV cache read
through a block list, as in vLLM's paged attention and its unified Triton attention: one program per
(sequence, query tile, kv head, kv split); the rows of a tile are the ``GROUP`` query heads of one kv head for
consecutive query tokens, so decode (1 query per sequence) and causal prefill chunks share one kernel and
each K/V tile is read once per GQA group. The blocks need not be contiguous or sorted: each key's position
comes from ``block_indices``. Long parts are split over the KV (flash-decoding) and the splits merged with
``merge.py``, the same exact merge that DistAttention uses across holders. Tile sizes, warps and the number
of splits come from ``launch_plan.py``, which argues each choice.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from infinite_llm.core.attention import PartialAttentionMetadata
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_dtype,
    check_shape,
    interpreting,
    next_power_of_2,
)
from infinite_llm.kernels.launch_plan import AttentionShape, LaunchPlan, TileOverrides, plan_launch
from infinite_llm.kernels.merge import launch_merge


@triton.jit
def _load_kv_tile(
    k_ptr, v_ptr, ids_ptr, idx_ptr, slot0, slot_hi, context_len, kv_head, head_dim,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """K, V ``[BLOCK_N, BLOCK_D]`` of block slots ``slot0 ..``, key positions and validity ``[BLOCK_N]``."""
    j = tl.arange(0, BLOCK_N)
    slot = slot0 + j // BLOCK_SIZE
    offset = j % BLOCK_SIZE
    slot_ok = slot < slot_hi
    block_id = tl.load(ids_ptr + slot, mask=slot_ok, other=0)
    key_pos = tl.load(idx_ptr + slot, mask=slot_ok, other=0) * BLOCK_SIZE + offset
    key_ok = slot_ok & (key_pos < context_len)  # stale slots past the context are never read
    d = tl.arange(0, BLOCK_D)
    mask = key_ok[:, None] & (d < head_dim)[None, :]
    k_offs = block_id[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    v_offs = block_id[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
    k = tl.load(k_ptr + k_offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + v_offs, mask=mask, other=0.0)
    return k, v, key_pos, key_ok


@triton.jit
def _online_softmax_step(q, k, v, key_pos, key_ok, query_pos, qk_scale, m, denom, acc, UPCAST: tl.constexpr):
    """Fold one K/V tile into the running max ``m``, sum ``denom`` (base 2) and output ``acc`` of each row."""
    if UPCAST:  # fp32 math: exact fp32 inputs, and the interpreter (whose bf16 dot is wrong)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
    s = tl.where(visible, s * qk_scale, float("-inf"))  # (BLOCK_M, BLOCK_N), log2 units
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite, p = 0
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


# Triton compiles a variant per "== 1" / "% 16 == 0" pattern of integer arguments; these three change as
# contexts grow during serving, and specializing them buys nothing, so they would only add recompiles.
@triton.jit(do_not_specialize=["max_blocks", "num_splits", "split_align"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    query_start_loc_ptr, query_positions_ptr, block_ids_ptr, block_indices_ptr, num_blocks_ptr,
    context_lens_ptr,
    qk_scale, head_dim, max_blocks, num_splits, split_align,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_seqs, query tiles, num_kv_heads * num_splits)``; writes ``out[split]``, ``lse[split]``.

    Each sequence spreads its own ``num_blocks`` over the ``num_splits`` splits (``split_align`` blocks at
    least, a whole multiple of them), so a short sequence in a batch sized for a long one (a CUDA-graph
    bucket's full-width block table) uses as many programs as its length deserves; splits past its blocks
    write ``lse = -inf``.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(2) // num_splits
    split = (tl.program_id(2) % num_splits).to(tl.int64)
    q_lo = tl.load(query_start_loc_ptr + seq)
    q_hi = tl.load(query_start_loc_ptr + seq + 1)
    rows = tl.arange(0, BLOCK_M)
    tok = q_lo + tl.program_id(1) * (BLOCK_M // GROUP) + rows // GROUP  # (BLOCK_M,) query token of each row
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (tok < q_hi)
    query_pos = tl.load(query_positions_ptr + tok, mask=row_ok, other=-1)
    d = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (d < head_dim)[None, :]
    q_offs = tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    seq_blocks = tl.load(num_blocks_ptr + seq)
    blocks_per_split = tl.maximum(split_align, tl.cdiv(tl.cdiv(seq_blocks, num_splits), split_align) * split_align)
    slot_lo = split * blocks_per_split
    slot_hi = tl.minimum(seq_blocks, slot_lo + blocks_per_split)
    slot_hi = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, slot_hi, slot_lo)  # tile past the queries: skip
    context_len = tl.load(context_lens_ptr + seq)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for slot0 in range(slot_lo, slot_hi, BLOCK_N // BLOCK_SIZE):
        k, v, key_pos, key_ok = _load_kv_tile(
            k_ptr, v_ptr, block_ids_ptr + seq * max_blocks, block_indices_ptr + seq * max_blocks,
            slot0, slot_hi, context_len, kv_head, head_dim,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_SIZE, BLOCK_D,
        )  # fmt: skip
        m, denom, acc = _online_softmax_step(q, k, v, key_pos, key_ok, query_pos, qk_scale, m, denom, acc, UPCAST)
    seen = denom > 0  # denom == 0 iff the row saw no key: out 0, lse -inf
    denom = tl.where(seen, denom, 1.0)
    out = acc / denom[:, None]
    lse = tl.where(seen, (m + tl.log2(denom)) * 0.6931471805599453, float("-inf"))  # base 2 -> natural
    o_offs = split * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


def triton_partial_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PartialAttentionMetadata,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
    tiles: TileOverrides | None = None,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the rBlocks listed in ``meta`` only, on the device.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp32/fp16/bf16, RoPE applied.
        k_cache, v_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]`` in ``query.dtype``;
            ``block_size`` a power of two, ``num_heads`` a multiple of ``num_kv_heads``.
        meta: visibility of keys (int32/int64 tensors), see :class:`PartialAttentionMetadata`. Block ids
            are trusted to lie in ``[0, num_pool_blocks)`` (``meta.validate`` checks them; not repeated here).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        num_splits: KV splits per sequence (merged exactly); default: enough to fill the GPU.
        tiles: tile sizes, warps, stages forced for tests and tuning (``num_splits`` wins over
            ``tiles.num_splits``); default: the policy of ``launch_plan.py``.
        max_query_len: the longest query run of a sequence, when the caller knows it (decode: 1). Given,
            the call makes no host sync, so it can be captured in a CUDA graph; ``query_start_loc`` is then
            trusted. Default: read from ``query_start_loc`` (one host sync, and the runs are checked).

    Returns:
        ``(partial_out [num_tokens, num_heads, head_dim]`` in ``query.dtype``, ``lse [num_tokens, num_heads]``
        fp32, natural log``)``; a query that sees no key gets ``out = 0, lse = -inf``. Math in fp32.

    Raises:
        InvalidRequest: wrong dtype, shape, head counts, ``query_start_loc``, tensors off the device
            (CUDA, or CPU under ``TRITON_INTERPRET=1``), or forced tiles the kernel cannot run.

    One host sync (reads ``query_start_loc``) unless ``max_query_len`` is given. Torch reference:
    ``core.attention.partial_attention``.
    """
    _check_inputs(query, k_cache, v_cache, meta)
    num_tokens, num_heads, head_dim = query.shape
    if meta.num_seqs == 0 or num_tokens == 0:
        out = torch.zeros(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        return out, torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float32, device=query.device)
    forced = tiles or TileOverrides()
    if num_splits is not None:
        forced = dataclasses.replace(forced, num_splits=num_splits)
    plan = plan_launch(_shape(query, k_cache, meta, max_query_len), _num_sms(query.device), forced)
    # every (token, head) row is written: query tiles cover each sequence's run, which cover all tokens
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=query.device)
    if plan.num_splits == 1:
        _launch(query, k_cache, v_cache, meta, scale, plan, out.unsqueeze(0), lse.unsqueeze(0))
        return out, lse
    # (num_splits, T, H, D) fp32 partials, merged exactly like parts from different holders
    part_out = torch.empty(plan.num_splits, *out.shape, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(plan.num_splits, *lse.shape, dtype=torch.float32, device=query.device)
    _launch(query, k_cache, v_cache, meta, scale, plan, part_out, part_lse)
    launch_merge(part_out, part_lse, out, lse)
    return out, lse


def _check_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PartialAttentionMetadata
) -> None:
    """Dtypes, shapes, head counts and devices; raises :class:`InvalidRequest` naming the bad input."""
    if query.dim() != 3 or k_cache.dim() != 4:
        raise InvalidRequest(f"query {tuple(query.shape)} must be 3-D and k_cache {tuple(k_cache.shape)} 4-D")
    check_dtype("query", query, FLOAT_DTYPES)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, cache, (query.dtype,))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise InvalidRequest(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.shape[3] != head_dim:
        raise InvalidRequest(f"k_cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if block_size & (block_size - 1) or block_size == 0:
        raise InvalidRequest(f"block_size {block_size} must be a power of two for the Triton kernel")
    _check_meta(meta, num_tokens)
    tensors = {"query": query, "k_cache": k_cache, "v_cache": v_cache}
    tensors.update({f"meta.{name}": getattr(meta, name) for name in _META_FIELDS})
    check_device(_paged_attention_kernel, tensors)


_META_FIELDS = (
    "query_start_loc",
    "query_positions",
    "block_ids",
    "block_indices",
    "num_blocks",
    "context_lens",
)


def _check_meta(meta: PartialAttentionMetadata, num_tokens: int) -> None:
    """Shapes and integer dtypes of the metadata tensors (no host sync)."""
    for name in _META_FIELDS:
        check_dtype(f"meta.{name}", getattr(meta, name), INDEX_DTYPES)
    s = meta.num_seqs
    check_shape("meta.query_start_loc", meta.query_start_loc, (s + 1,))
    check_shape("meta.query_positions", meta.query_positions, (num_tokens,))
    check_shape("meta.num_blocks", meta.num_blocks, (s,))
    if meta.block_ids.dim() != 2 or meta.block_ids.shape[0] != s:
        shape = tuple(meta.block_ids.shape)
        raise InvalidRequest(f"meta.block_ids has shape {shape}; expected [{s}, max_blocks]")
    check_shape("meta.block_indices", meta.block_indices, tuple(meta.block_ids.shape))


def _max_query_len(query_start_loc: torch.Tensor, num_tokens: int) -> int:
    """Longest query run of a sequence; checks ``query_start_loc`` runs from 0 to ``num_tokens`` upwards."""
    starts = query_start_loc.tolist()  # the one host sync: the grid needs the longest run
    lens = [hi - lo for lo, hi in zip(starts, starts[1:], strict=False)]
    if starts[0] != 0 or starts[-1] != num_tokens or min(lens) < 0:
        raise InvalidRequest(f"query_start_loc must rise from 0 to {num_tokens}; got {starts}")
    return max(lens)


def _shape(
    query: torch.Tensor, k_cache: torch.Tensor, meta: PartialAttentionMetadata, max_query_len: int | None
) -> AttentionShape:
    """The launch-relevant scalars of checked inputs (one host sync for the longest query run, unless given)."""
    num_tokens, num_heads, head_dim = query.shape
    if max_query_len is None:
        max_query_len = _max_query_len(meta.query_start_loc, num_tokens)
    elif not 1 <= max_query_len <= num_tokens:
        raise InvalidRequest(f"max_query_len {max_query_len} must lie in [1, {num_tokens}]")
    return AttentionShape(
        num_seqs=meta.num_seqs,
        max_query_len=max_query_len,
        max_blocks=meta.block_ids.shape[1],
        num_kv_heads=k_cache.shape[2],
        group=num_heads // k_cache.shape[2],
        head_dim=head_dim,
        block_size=k_cache.shape[1],
        elem_bytes=query.element_size(),
    )


def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 0 elsewhere (the interpreter gains nothing from splits)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PartialAttentionMetadata,
    scale: float | None,
    plan: LaunchPlan,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Run the kernel into ``out [num_splits, T, H, D]``, fp32 ``lse [num_splits, T, H]`` (inputs checked)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    query = query.contiguous()
    k_cache, v_cache = _unit_last_stride(k_cache), _unit_last_stride(v_cache)
    idx = [getattr(meta, name).to(torch.int64).contiguous() for name in _META_FIELDS]
    upcast = query.dtype == torch.float32 or interpreting(_paged_attention_kernel)
    grid = (meta.num_seqs, plan.num_q_tiles, num_kv_heads * plan.num_splits)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, lse, *idx,
        scale * math.log2(math.e), head_dim, meta.block_ids.shape[1], plan.num_splits, plan.split_align,
        query.stride(0), query.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_SIZE=block_size,
        BLOCK_D=max(16, next_power_of_2(head_dim)), UPCAST=upcast,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip


def _unit_last_stride(cache: torch.Tensor) -> torch.Tensor:
    """The cache itself if ``head_dim`` is contiguous (a strided pool view is fine), else a copy."""
    return cache if cache.stride(-1) == 1 else cache.contiguous()
