"""DistAttention math: paged partial attention over a subset of a sequence's rBlocks, and the exact merge.

This is the torch reference (and the CPU path). ``infinite_llm/kernels/`` holds the Triton versions with the
same signatures. The math is PAPER.md "DistAttention" (MicroAttention + merge; Lin et al. 2024, §4.1),
written in the lse form of FlashAttention-2 / vLLM's ``merge_attn_states``: each part returns its
normalised output and ``lse = m + log(sum exp(s - m))``; the merge is exact and associative.

Neighbours: ``kv_cache.py`` owns the paged storage these functions read; the engine's attention backend
(``core/dist_attention.py``) splits a step over holders and calls :func:`merge_partials`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infinite_llm.core.errors import InvalidRequest

# Decode reads the whole context once per step: above LONG_DECODE_BLOCKS rBlocks per sequence it goes chunk
# by chunk (CHUNK_BLOCKS rBlocks, ~4 MiB of K+V at 8 KV heads x 128 fp32) so each chunk stays in cache.
LONG_DECODE_BLOCKS = 128
CHUNK_BLOCKS = 32


@dataclass(frozen=True)
class PartialAttentionMetadata:
    """Which keys each query may see, for a batch of sequences served by one holder of KV.

    All tensors are int64 on the device of the KV cache.

    Attributes:
        query_start_loc: ``[num_seqs + 1]`` cumulative query-token counts; sequence ``s`` owns query rows
            ``query_start_loc[s]:query_start_loc[s+1]``.
        query_positions: ``[num_tokens]`` absolute position (token index in its sequence) of each query.
        block_ids: ``[num_seqs, max_blocks]`` physical rBlock ids in the pool; row entries at or beyond
            ``num_blocks[s]`` are padding and never read.
        block_indices: ``[num_seqs, max_blocks]`` logical index of each rBlock in the sequence's block
            table; block index ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``.
        num_blocks: ``[num_seqs]`` valid entries per row of ``block_ids`` (may be 0: an empty part).
        context_lens: ``[num_seqs]`` tokens of the sequence whose KV exists after this step's append.

    A key at token position ``t`` is visible to a query at position ``p`` iff ``t < context_len`` and
    ``t <= p`` (causal). Decode is the case of one query per sequence at ``context_len - 1``.
    """

    query_start_loc: torch.Tensor
    query_positions: torch.Tensor
    block_ids: torch.Tensor
    block_indices: torch.Tensor
    num_blocks: torch.Tensor
    context_lens: torch.Tensor
    # Per-step work that every layer would otherwise redo (which pool slots a sequence reads, its mask);
    # filled lazily by partial_attention, keyed by what it depends on. Not part of the metadata's value.
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def validate(self, num_tokens: int, num_pool_blocks: int) -> None:
        """Check shapes and ranges; raises :class:`InvalidRequest` naming the bad field."""
        s = self.num_seqs
        _expect(self.query_start_loc.shape == (s + 1,), "query_start_loc", self.query_start_loc.shape)
        _expect(self.query_positions.shape == (num_tokens,), "query_positions", self.query_positions.shape)
        _expect(self.block_ids.shape == self.block_indices.shape, "block_indices", self.block_indices.shape)
        _expect(self.block_ids.dim() == 2 and self.block_ids.shape[0] == s, "block_ids", self.block_ids.shape)
        _expect(self.num_blocks.shape == (s,), "num_blocks", self.num_blocks.shape)
        if s and int(self.query_start_loc[-1]) != num_tokens:
            raise InvalidRequest(f"query_start_loc ends at {int(self.query_start_loc[-1])}, not {num_tokens}")
        if s and bool((self.num_blocks > self.block_ids.shape[1]).any()):
            raise InvalidRequest("num_blocks exceeds the width of block_ids")
        valid = torch.arange(self.block_ids.shape[1], device=self.block_ids.device)[None, :] < self.num_blocks[:, None]
        ids = self.block_ids[valid]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pool_blocks):
            raise InvalidRequest(f"block id out of range [0, {num_pool_blocks})")


def _expect(ok: bool, field: str, shape: object) -> None:
    if not ok:
        raise InvalidRequest(f"{field} has a wrong shape {tuple(shape)}")  # type: ignore[arg-type]


def partial_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PartialAttentionMetadata,
    scale: float | None = None,
    *,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the rBlocks listed in ``meta`` only (one MicroAttention per sequence).

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float (fp32/bf16/fp16), RoPE already applied.
        k_cache, v_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``, one layer of the pool.
            ``num_heads`` must be a multiple of ``num_kv_heads`` (MHA, GQA, MQA); query head ``h`` reads
            KV head ``h // (num_heads // num_kv_heads)``.
        meta: visibility of keys, see :class:`PartialAttentionMetadata`.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        max_query_len: a launch hint of the Triton kernel (the longest query run); unused here.

    Returns:
        ``(partial_out, lse)``: ``partial_out [num_tokens, num_heads, head_dim]`` in ``query.dtype``,
        normalised over the visible keys of this part; ``lse [num_tokens, num_heads]`` fp32, natural log.
        A query that sees no key gets ``partial_out = 0`` and ``lse = -inf`` (weight 0 in the merge).

    Computation is in fp32 whatever the input dtype. Source: PAPER.md "DistAttention" (MA_j).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise InvalidRequest(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    kind = _step_kind(meta) if meta.num_seqs and num_tokens else "empty"
    if kind == "decode" and meta.block_ids.shape[1]:
        out, lse = _decode_batched(query, k_cache, v_cache, meta, scale)
        return out.to(query.dtype), lse
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float32, device=query.device)
    if kind in ("empty", "decode"):
        return out.to(query.dtype), lse
    if kind == "long decode":
        _decode_chunked(query, k_cache, v_cache, meta, scale, out, lse)
    else:
        seq_keys = _prefill_keys(meta, k_cache.shape[1])
        if len(seq_keys) == 1 and seq_keys[0].query_lo == 0 and seq_keys[0].query_hi == num_tokens:
            whole, whole_lse = _prefill_attention(query, k_cache, v_cache, seq_keys[0], scale)  # no copy into out
            return whole.to(query.dtype), whole_lse
        for keys in seq_keys:
            rows = slice(keys.query_lo, keys.query_hi)
            out[rows], lse[rows] = _prefill_attention(query[rows], k_cache, v_cache, keys, scale)
    return out.to(query.dtype), lse


_Part = tuple[torch.Tensor, torch.Tensor]  # (out [T, H, D], lse [T, H]) fp32


def _step_kind(meta: PartialAttentionMetadata) -> str:
    """``"decode"`` (one query per sequence), ``"long decode"`` (one, and a context past
    ``LONG_DECODE_BLOCKS``) or ``"prefill"``; cached on ``meta`` (every layer of a step asks)."""
    if "kind" not in meta.cache:
        starts = meta.query_start_loc.tolist()
        if any(starts[i + 1] - starts[i] != 1 for i in range(meta.num_seqs)):
            meta.cache["kind"] = "prefill"
        else:
            meta.cache["kind"] = "long decode" if int(meta.num_blocks.max()) > LONG_DECODE_BLOCKS else "decode"
    return meta.cache["kind"]


@dataclass(frozen=True)
class _SeqKeys:
    """The keys one sequence's queries read in a prefill step; computed once per step, reused by every layer.

    Keys come in two parts, each as flat pool slots (``block_id * block_size + offset``) in position order:
    ``prefix_slots [P]`` are visible to every query (no mask; in a prefill chunk, the earlier chunks), and
    ``slots [S]`` the rest that at least one query sees. Either part may instead be a ``slice`` of the pool
    when its slots are consecutive (blocks allocated in order, the common case): read as a view, no gather.
    For the rest, ``mask [T, S]`` is fp32 additive
    (0 visible, -inf hidden), or None when ``causal`` (key ``j`` visible to query ``i`` iff ``j <= i``: the
    chunk's own tokens); ``no_key [T]`` bool marks queries that see none of them (None when all see one).
    """

    query_lo: int
    query_hi: int
    prefix_slots: torch.Tensor | slice
    slots: torch.Tensor | slice
    mask: torch.Tensor | None
    causal: bool
    no_key: torch.Tensor | None


def _prefill_keys(meta: PartialAttentionMetadata, block_size: int) -> list[_SeqKeys]:
    """:class:`_SeqKeys` of every sequence with queries and keys here, cached on ``meta`` for later layers."""
    key = ("prefill", block_size)
    if key not in meta.cache:
        starts, nblocks = meta.query_start_loc.tolist(), meta.num_blocks.tolist()
        found = (_seq_keys(meta, s, starts[s], starts[s + 1], nblocks[s], block_size) for s in range(meta.num_seqs))
        meta.cache[key] = [k for k in found if k is not None]
    return meta.cache[key]


def _seq_keys(meta: PartialAttentionMetadata, s: int, lo: int, hi: int, n: int, block_size: int) -> _SeqKeys | None:
    if hi == lo or n == 0:
        return None
    offsets = torch.arange(block_size, device=meta.block_ids.device)
    kpos = (meta.block_indices[s, :n, None] * block_size + offsets).flatten()  # (n*bs,)
    slots = (meta.block_ids[s, :n, None] * block_size + offsets).flatten()
    qpos = meta.query_positions[lo:hi]  # (T,)
    keep = (kpos < meta.context_lens[s]) & (kpos <= qpos.max())
    kpos, order = kpos[keep].sort()  # (P + S,)
    if kpos.numel() == 0:
        return None
    slots = slots[keep][order]
    num_prefix = int((kpos < qpos.min()).sum())  # sorted, so these lead; each query sees them all
    kpos = kpos[num_prefix:]
    visible = kpos[None, :] <= qpos[:, None]  # (T, S)
    no_key = ~visible.any(dim=1)
    causal = kpos.numel() == qpos.numel() and torch.equal(kpos, qpos)  # positions are unique, so j <= i
    mask = None if causal else _additive(visible)
    no_key = no_key if bool(no_key.any()) else None
    return _SeqKeys(lo, hi, _as_range(slots[:num_prefix]), _as_range(slots[num_prefix:]), mask, causal, no_key)


def _as_range(slots: torch.Tensor) -> torch.Tensor | slice:
    """``slots [n]`` as ``slice(first, first + n)`` when they are consecutive (a view replaces a gather)."""
    n = slots.numel()
    if n and int(slots[-1]) - int(slots[0]) == n - 1 and bool((slots.diff() == 1).all()):
        return slice(int(slots[0]), int(slots[0]) + n)
    return slots


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """Bool visibility -> fp32 additive mask of the same shape (0 visible, -inf hidden)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, -math.inf)


def _prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: _SeqKeys, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q [T, H, D]`` over the keys in ``keys`` -> ``(out [T, H, D] fp32, lse [T, H] fp32)``.

    The unmasked prefix and the masked (or causal) rest are two kernel calls, merged exactly: a mask costs
    a read per score, and a causal call skips the hidden half of the chunk's own tokens.
    """
    prefix = None
    if _count(keys.prefix_slots):
        prefix = _attention_over_prefix(q, k_cache, v_cache, keys.prefix_slots, scale)
    if not _count(keys.slots):
        assert prefix is not None, "a sequence's keys are never both empty"
        return prefix
    out, lse = _attention_over(q, k_cache, v_cache, keys.slots, keys.mask, keys.causal, scale)
    if keys.no_key is not None:  # the CPU kernel leaves these rows finite; the contract says 0 and -inf
        out = out.masked_fill(keys.no_key[:, None, None], 0.0)
        lse = lse.masked_fill(keys.no_key[:, None], -math.inf)
    return (out, lse) if prefix is None else _merge_two(prefix, (out, lse))


def _count(slots: torch.Tensor | slice) -> int:
    return slots.stop - slots.start if isinstance(slots, slice) else slots.numel()


def _gather(cache: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    """Rows ``slots`` of one layer's pool ``[num_pool_blocks, block_size, Hkv, D]`` -> ``[S, Hkv, D]`` fp32."""
    flat = cache.view(-1, *cache.shape[2:])  # (num_pool_blocks * block_size, Hkv, D)
    return (flat[slots] if isinstance(slots, slice) else flat.index_select(0, slots)).float()


def _merge_two(a: _Part, b: _Part) -> _Part:
    """:func:`merge_partials` of two parts ``(out [T, H, D], lse [T, H])`` fp32 where ``a``'s lse is finite and
    both outputs are finite (a prefill chunk: every query sees the earlier chunks). Without the stack and the
    NaN guard of the general merge: 2 passes over the outputs instead of ~8 (~10x faster at 2,048 tokens)."""
    lse = torch.logaddexp(a[1], b[1])  # (T, H), finite since a[1] is
    out = a[0] * torch.exp(a[1] - lse).unsqueeze(-1)  # (T, H, D)
    return out.addcmul_(b[0], torch.exp(b[1] - lse).unsqueeze(-1)), lse


def _attention_over_prefix(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | slice, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]`` over keys every query sees (no mask) -> ``(out [T, H, D], lse [T, H])`` fp32.

    The ``G`` query heads sharing a KV head go on the query axis, ``q [1, Hkv, G*T, D]`` against
    ``k [1, Hkv, S, D]``: exact (no mask, so a query's row does not depend on its neighbours; bitwise equal to
    :func:`_attention_over` on the development CPU), and the CPU kernel picks its larger query tile for
    ``G*T >= 768`` (256 rows, not 64): ~10% faster for a 512-token chunk.
    """
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    k = _gather(k_cache, slots).permute(1, 0, 2).unsqueeze(0)  # (1, Hkv, S, D)
    v = _gather(v_cache, slots).permute(1, 0, 2).unsqueeze(0)
    qf = q.float().view(t, hkv, h // hkv, d).permute(1, 2, 0, 3).reshape(1, hkv, -1, d)  # (1, Hkv, G*T, D)
    out, lse = _attention_lse(qf, k, v, None, False, scale)  # (1, Hkv, G*T, D), (1, Hkv, G*T)
    out = out.view(hkv, h // hkv, t, d).permute(2, 0, 1, 3).reshape(t, h, d)
    return out, lse.view(hkv, h // hkv, t).permute(2, 0, 1).reshape(t, h)


def _attention_over(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor | slice,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]`` over the keys at flat pool ``slots [S]`` -> ``(out [T, H, D], lse [T, H])`` fp32."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    g = h // hkv
    k = _gather(k_cache, slots)  # (S, Hkv, D)
    v = _gather(v_cache, slots)
    qf = q.float().view(t, hkv, g, d).permute(1, 2, 0, 3)  # (Hkv, G, T, D)
    kf = k.permute(1, 0, 2).unsqueeze(1).expand(hkv, g, -1, d)  # (Hkv, G, S, D), no copy over G
    vf = v.permute(1, 0, 2).unsqueeze(1).expand(hkv, g, -1, d)
    out, lse = _attention_lse(qf, kf, vf, mask, causal, scale)  # (Hkv, G, T, D), (Hkv, G, T)
    return out.permute(2, 0, 1, 3).reshape(t, h, d), lse.permute(2, 0, 1).reshape(t, h)


def _attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, T, D]``, ``k, v [B, H, S, D]`` fp32 (strided views are fine), ``mask`` fp32 additive,
    broadcastable to ``[B, H, T, S]``, or None; ``causal``: key ``j`` visible to query ``i`` iff ``j <= i``.

    Returns ``(out [B, H, T, D], lse [B, H, T])`` fp32, natural log. On CPU this is torch's tiled
    flash-attention kernel (the one behind SDPA; it also returns lse), so no ``[T, S]`` scores are
    materialised; elsewhere the plain masked softmax. Rows with no visible key are the caller's to fix.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    return _softmax_lse(q, k, v, mask, causal, scale)


def _softmax_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_attention_lse` by the textbook formula, materialising ``scores [B, H, T, S]`` (any device)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, T, S)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), -math.inf)
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, T); -inf where no key is visible
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(probs, v), lse


@dataclass(frozen=True)
class _DecodeKeys:
    """Decode step (one query per sequence), padded to the longest: ``blocks [num_seqs * max_blocks]`` int64
    pool block ids, row-major (block 0 where padding), so a sequence's keys are ``L = max_blocks * block_size``
    rows; ``mask [num_seqs, 1, 1, L]`` fp32 additive, ``no_key [num_seqs]`` bool or None."""

    blocks: torch.Tensor
    mask: torch.Tensor
    no_key: torch.Tensor | None


def _decode_keys(meta: PartialAttentionMetadata, block_size: int) -> _DecodeKeys:
    """:class:`_DecodeKeys` of a decode step, cached on ``meta`` for later layers."""
    key = ("decode", block_size)
    if key not in meta.cache:
        max_blocks = meta.block_ids.shape[1]
        valid_block = torch.arange(max_blocks, device=meta.block_ids.device)[None, :] < meta.num_blocks[:, None]
        offsets = torch.arange(block_size, device=meta.block_ids.device)
        blocks = torch.where(valid_block, meta.block_ids, 0).flatten()  # (S * max_blocks,)
        kpos = (meta.block_indices[:, :, None] * block_size + offsets).flatten(1)  # (S, L)
        visible = valid_block.repeat_interleave(block_size, dim=1)
        visible &= (kpos <= meta.query_positions[:, None]) & (kpos < meta.context_lens[:, None])
        no_key = ~visible.any(dim=1)
        mask = _additive(visible)[:, None, None, :]  # (S, 1, 1, L)
        meta.cache[key] = _DecodeKeys(blocks, mask, no_key if bool(no_key.any()) else None)
    return meta.cache[key]


def _decode_batched(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PartialAttentionMetadata, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence: every sequence's keys gathered into one padded batch (no Python loop).
    Returns ``(out [num_seqs, num_heads, head_dim], lse [num_seqs, num_heads])`` fp32.

    GQA without copying K/V: the ``G`` query heads that share a KV head take the place of the query-length
    axis, ``q [S, Hkv, G, D]`` against ``k [S, Hkv, L, D]``; they all see the same keys. The gather copies
    whole rBlocks (``block_size`` rows each) rather than token rows: the same bytes in 1/block_size as many
    copies (20 us instead of 25-29 us per K or V at batch 16 x 48 tokens of SmolLM2's shape on one core).
    """
    num_seqs = meta.block_ids.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    keys = _decode_keys(meta, k_cache.shape[1])
    length = meta.block_ids.shape[1] * k_cache.shape[1]  # L: max_blocks rBlocks of block_size keys
    k = k_cache.index_select(0, keys.blocks).float()  # (S*max_blocks, block_size, Hkv, D)
    v = v_cache.index_select(0, keys.blocks).float()
    k = k.view(num_seqs, length, num_kv_heads, head_dim).permute(0, 2, 1, 3)  # (S, Hkv, L, D)
    v = v.view(num_seqs, length, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    q = query.float().view(num_seqs, num_kv_heads, -1, head_dim)  # (S, Hkv, G, D)
    seq_out, seq_lse = _attention_lse(q, k, v, keys.mask, False, scale)  # (S, Hkv, G, D), (S, Hkv, G)
    out, lse = seq_out.reshape(query.shape), seq_lse.reshape(query.shape[:2])
    if keys.no_key is not None:  # the CPU kernel leaves these rows finite; the contract says 0 and -inf
        out = out.masked_fill(keys.no_key[:, None, None], 0.0)
        lse = lse.masked_fill(keys.no_key[:, None], -math.inf)
    return out, lse


def _decode_chunked(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PartialAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Decode over long contexts: per sequence, ``CHUNK_BLOCKS`` rBlocks at a time, merged exactly.

    Why: gathering a whole long context at once streams it through memory three times (gather, layout
    copy inside einsum, read); a chunk that fits in cache is gathered once and read from cache, which made
    this ~4x faster at 32k tokens on the development CPU (benchmarks/attention_bandwidth.py). The chunks
    are MicroAttentions of one holder, merged with :func:`merge_partials`.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    g = query.shape[1] // num_kv_heads
    offsets = torch.arange(block_size, device=query.device)
    nblocks = meta.num_blocks.tolist()
    for s in range(meta.num_seqs):
        q = query[s].float().view(num_kv_heads, g, head_dim) * scale  # (Hkv, G, D)
        parts_out, parts_lse = [], []
        for c in range(0, nblocks[s], CHUNK_BLOCKS):
            ids = meta.block_ids[s, c : min(c + CHUNK_BLOCKS, nblocks[s])]
            kpos = (meta.block_indices[s, c : c + ids.numel(), None] * block_size + offsets).flatten()
            visible = (kpos <= meta.query_positions[s]) & (kpos < meta.context_lens[s])  # (n,)
            k = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim).transpose(0, 1).float()  # (Hkv, n, D)
            v = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim).transpose(0, 1).float()
            scores = torch.bmm(q, k.transpose(1, 2)).masked_fill(~visible, -math.inf)  # (Hkv, G, n)
            chunk_lse = torch.logsumexp(scores, dim=-1)  # (Hkv, G)
            probs = torch.exp(scores - torch.where(torch.isinf(chunk_lse), 0.0, chunk_lse).unsqueeze(-1))
            parts_out.append(torch.bmm(probs, v))  # (Hkv, G, D)
            parts_lse.append(chunk_lse)
        if parts_out:
            merged, merged_lse = merge_partials(torch.stack(parts_out), torch.stack(parts_lse))
            out[s] = merged.reshape(-1, head_dim)
            lse[s] = merged_lse.reshape(-1)


def merge_partials(
    partial_outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results over disjoint sets of keys.

    Args:
        partial_outs: ``num_parts`` tensors ``[num_tokens, num_heads, head_dim]`` (or one stacked
            ``[num_parts, num_tokens, num_heads, head_dim]``), any float dtype.
        lses: matching ``[num_tokens, num_heads]`` fp32 (or stacked ``[num_parts, ...]``).

    Returns:
        ``(out, lse)`` with ``lse = logsumexp_j(lse_j)`` and ``out = sum_j exp(lse_j - lse) * out_j``, in the
        dtype of the first part. Parts with ``lse = -inf`` have weight 0 (their output is never read, so a
        NaN there cannot leak); if every part is empty the result is ``out = 0, lse = -inf``.

    Source: DESIGN.md §2 "merge"; PAPER.md DistAttention merge. Associative: merging merged results equals
    merging all parts at once.
    """
    outs = partial_outs if isinstance(partial_outs, torch.Tensor) else torch.stack(list(partial_outs))
    ls = lses if isinstance(lses, torch.Tensor) else torch.stack(list(lses))
    if outs.shape[0] == 0:
        raise InvalidRequest("merge_partials needs at least one part")
    dtype = outs.dtype
    ls = ls.float()
    lse = torch.logsumexp(ls, dim=0)  # (T, H); -inf iff every part is -inf
    weights = torch.exp(ls - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(0))  # (P, T, H)
    weighted = torch.where(weights.unsqueeze(-1) > 0, weights.unsqueeze(-1) * outs.float(), 0.0)
    return weighted.sum(dim=0).to(dtype), lse


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Store new keys/values into their slots (``block_id * block_size + offset``) of one layer's pool.

    Args:
        k_cache, v_cache: ``[num_pool_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_new_tokens]`` int64; a slot < 0 (a padding row of a CUDA-graph batch) is skipped,
            as in vLLM's ``reshape_and_cache``.
        key, value: ``[num_new_tokens, num_kv_heads, head_dim]``, cast to the cache dtype.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # syncs on a device; the Triton kernel (kernels.write_kv) masks instead
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if slot_mapping.numel() == 0:
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
