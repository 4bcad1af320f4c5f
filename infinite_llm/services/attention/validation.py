"""Checks of an AttendStep's tensors and indices against the server's KV layout, before any state changes.

``RManager.plan_step`` already checks ownership and positions; this adds what a remote caller can get
wrong on top: dtypes and shapes against the layout, non-finite values, and inconsistent index lists.
Every failure raises :class:`~infinite_llm.core.errors.InvalidRequest` naming the sequence and field.
"""

from __future__ import annotations

import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.services.attention.types import SeqAttendParams


def check_step(items: list[SeqAttendParams], layout: KVLayout) -> None:
    """Validate a whole step; the query head count must be one value for every sequence."""
    seen: set[str] = set()
    num_heads = {it.query.shape[1] for it in items if it.query.dim() == 3}
    if len(num_heads) > 1:
        raise InvalidRequest(f"queries of one step disagree on num_heads: {sorted(num_heads)}")
    for it in items:
        if it.seq_id in seen:
            raise InvalidRequest(f"sequence {it.seq_id!r} appears twice in one step")
        seen.add(it.seq_id)
        check_item(it, layout)


def check_item(it: SeqAttendParams, layout: KVLayout) -> None:
    """Validate one sequence's share of a step (shapes, dtypes, finiteness, index lists)."""
    name = f"sequence {it.seq_id!r}"
    _check_query(it, layout, name)
    _check_new_kv(it, layout, name)
    if len(it.block_ids) != len(it.block_indices):
        raise InvalidRequest(f"{name}: {len(it.block_ids)} block_ids but {len(it.block_indices)} block_indices")
    _check_unique(it.block_ids, f"{name}: block_ids")
    _check_unique(it.block_indices, f"{name}: block_indices")
    _check_unique(it.slot_mapping, f"{name}: slot_mapping")
    if any(i < 0 for i in it.block_indices):
        raise InvalidRequest(f"{name}: negative block index in {list(it.block_indices)}")
    listed = set(it.block_ids)
    if any(slot // layout.block_size not in listed for slot in it.slot_mapping):
        raise InvalidRequest(f"{name}: a slot of slot_mapping lies outside the listed block_ids")


def _check_query(it: SeqAttendParams, layout: KVLayout, name: str) -> None:
    q = it.query
    if q.dtype != layout.dtype:
        raise InvalidRequest(f"{name}: query dtype {q.dtype} differs from the KV dtype {layout.dtype}")
    if q.dim() != 3 or q.shape[2] != layout.head_dim or q.shape[1] % layout.num_kv_heads:
        raise InvalidRequest(
            f"{name}: query shape {list(q.shape)} is not [num_tokens, num_heads, {layout.head_dim}] "
            f"with num_heads a multiple of {layout.num_kv_heads}"
        )
    if q.shape[0] == 0 or q.shape[0] != len(it.query_positions):
        raise InvalidRequest(f"{name}: {q.shape[0]} query rows for {len(it.query_positions)} query_positions")
    if not bool(torch.isfinite(q).all()):
        raise InvalidRequest(f"{name}: query holds NaN or infinite values")


def _check_new_kv(it: SeqAttendParams, layout: KVLayout, name: str) -> None:
    want = [len(it.slot_mapping), layout.num_kv_heads, layout.head_dim]
    for field, t in (("key", it.key), ("value", it.value)):
        if t is None:
            if want[0]:
                raise InvalidRequest(f"{name}: {field} missing for {want[0]} slots")
            continue
        if t.dtype != layout.dtype or list(t.shape) != want:
            raise InvalidRequest(f"{name}: {field} is {t.dtype} {list(t.shape)}, expected {layout.dtype} {want}")
        if not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{name}: {field} holds NaN or infinite values")


def _check_unique(values: list[int], field: str) -> None:
    if len(set(values)) != len(values):
        raise InvalidRequest(f"{field} repeats an entry: {list(values)}")


def check_payload(shape: list[int], dtype: torch.dtype, layout: KVLayout) -> int:
    """Validate a block-transfer payload ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

    Returns ``num_blocks`` (>= 1). Raises ``InvalidRequest`` when shape or dtype differ from ``layout``.
    """
    want = [2, layout.num_layers, None, layout.block_size, layout.num_kv_heads, layout.head_dim]
    ok = len(shape) == 6 and all(w is None or w == s for w, s in zip(want, shape, strict=True))
    if not ok or dtype != layout.dtype or shape[2] < 1:
        raise InvalidRequest(
            f"payload {dtype} {list(shape)} does not match this server's layout: "
            f"{layout.dtype} [2, {layout.num_layers}, num_blocks >= 1, {layout.block_size}, "
            f"{layout.num_kv_heads}, {layout.head_dim}]"
        )
    return shape[2]
