"""Prefix caching: the identity of a full rBlock, a hash chain over its tokens (vLLM's scheme).

A full rBlock (``block_size`` tokens) is named by ``blake2b(parent hash, model id, block size, its token
ids)``: two sequences whose first ``i * block_size`` tokens are equal have equal hashes for blocks ``0..i-1``
and may share those rBlocks' KV. A partial last block has no hash and is never shared. The hash is stable
across processes and machines (a canonical byte encoding, never Python's ``hash()``), so the cluster's one
index (the global manager's) can be written by any compute instance and read by any other.

Source: vLLM v1 ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``, ``BlockHash``) and
``kv_cache_manager.py`` (``get_computed_blocks``: at most ``num_tokens - 1`` tokens hit, so a prompt that is
a whole number of blocks recomputes its last block and there is a query to sample from).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32 bytes (blake2b, digest_size 32)
HASH_BYTES = 32
_ROOT = b"infinite-llm prefix cache v1"


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    parent: BlockHash | None = None,
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full rBlocks of ``token_ids[:num_tokens]`` (default: all), chained from ``parent``.

    Args:
        token_ids: token ids from the first token of the first block hashed (block ``k`` when ``parent`` is
            the hash of block ``k - 1``).
        block_size: tokens per rBlock (part of the identity: the same tokens under another block size are
            another block).
        model_id: the model whose KV the blocks hold (part of the identity).
        parent: the hash of the block before ``token_ids[0]`` (``None``: ``token_ids`` starts the sequence).
        num_tokens: hash only the full blocks of the first ``num_tokens`` token ids.

    Returns:
        One 32-byte hash per full block, in order; a partial last block has none.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    prefix = _ROOT + struct.pack("<I", block_size) + model_id.encode() + b"\0"
    out: list[BlockHash] = []
    prev = parent if parent is not None else b""
    for start in range(0, n - n % block_size, block_size):
        block = token_ids[start : start + block_size]
        h = hashlib.blake2b(prefix, digest_size=HASH_BYTES)
        h.update(struct.pack("<B", len(prev)) + prev)
        h.update(struct.pack(f"<{block_size}q", *block))
        prev = h.digest()
        out.append(prev)
    return out


def max_cache_hit_tokens(num_tokens: int, block_size: int) -> int:
    """The most tokens of a ``num_tokens``-token sequence the cache may serve: full blocks within its
    first ``num_tokens - 1`` tokens (the last token is always computed, so there is a query to sample)."""
    return max(num_tokens - 1, 0) // block_size * block_size
