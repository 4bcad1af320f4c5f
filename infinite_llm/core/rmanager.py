"""rManager: one holder's KV memory as rBlocks, which sequence owns which, and attention over them.

This is the core of an attention server (PAPER.md "Managers", rManager): an :class:`RBlockPool` for the
bookkeeping, a paged KV tensor per layer for the bytes, the per-sequence ownership, and the fused
"append new K/V into their slots, then partial attention over this holder's rBlocks" of DESIGN.md §3.
The single-process engine runs several of these in one process (one per partition); an attention server
wraps one behind gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinite_llm.core.attention import PartialAttentionMetadata, partial_attention, write_kv
from infinite_llm.core.block_pool import RBlockPool, Reservation
from infinite_llm.core.errors import InvalidRequest, NotFound

PartialAttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVLayout:
    """Shape of one holder's KV memory. ``bytes_per_block`` covers K and V of every layer."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class HolderSeqStep:
    """One sequence's share of a step on this holder.

    Attributes:
        seq_id: the sequence.
        query_positions: ``[num_query_tokens]`` positions of the step's queries (all of the sequence's
            new tokens: every holder sees every query).
        context_len: tokens whose KV exists after the step.
        block_ids / block_indices: this holder's rBlocks of the sequence (physical id, logical index).
        slot_mapping: ``[num_new_here]`` slots (``block_id * block_size + offset``) of the new tokens whose
            K/V this holder stores; ``new_token_rows`` are their rows among the sequence's query tokens.
    """

    seq_id: str
    query_positions: list[int]
    context_len: int
    block_ids: list[int]
    block_indices: list[int]
    slot_mapping: list[int]
    new_token_rows: list[int]


@dataclass(frozen=True)
class StepPlan:
    """Tensors of a validated step, reused by every layer. ``new_token_rows`` index the plan's queries."""

    meta: PartialAttentionMetadata
    slot_mapping: torch.Tensor
    new_token_rows: torch.Tensor
    num_tokens: int


class RManager:
    """KV memory of one holder: pool + paged KV ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        CapacityExhausted: not enough free rBlocks (nothing changes).
        NotFound: an unknown sequence or reservation.
        InvalidRequest: a step names blocks the sequence does not own, or bad positions.
    """

    def __init__(
        self,
        num_blocks: int,
        layout: KVLayout,
        device: torch.device | str = "cpu",
        attention_impl: PartialAttentionFn = partial_attention,
    ) -> None:
        self.layout = layout
        self.pool = RBlockPool(num_blocks)
        shape = (layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=layout.dtype, device=device)
        self._attention_impl = attention_impl
        self._owned: dict[str, list[int]] = {}
        self._pending: dict[int, str] = {}

    # ---- ownership ---------------------------------------------------------------------------------
    def allocate(self, seq_id: str, n: int) -> list[int]:
        """Allocate ``n`` rBlocks to ``seq_id`` (appended to what it owns here)."""
        ids = self.pool.allocate(n)
        self._owned.setdefault(seq_id, []).extend(ids)
        return ids

    def reserve(self, seq_id: str, n: int) -> Reservation:
        """Phase one of a remote placement: hold ``n`` blocks for ``seq_id`` without publishing them."""
        r = self.pool.reserve(n)
        self._pending[r.reservation_id] = seq_id
        return r

    def commit(self, reservation_id: int) -> list[int]:
        """Phase two: the reserved blocks now belong to their sequence."""
        seq_id = self._pending.get(reservation_id)
        if seq_id is None:
            raise NotFound(f"no reservation {reservation_id}")
        ids = self.pool.commit(reservation_id)
        del self._pending[reservation_id]
        self._owned.setdefault(seq_id, []).extend(ids)
        return ids

    def cancel(self, reservation_id: int) -> None:
        self.pool.cancel(reservation_id)
        self._pending.pop(reservation_id, None)

    def free_sequence(self, seq_id: str) -> int:
        """Free every rBlock (and pending reservation) of ``seq_id``; returns how many blocks were freed."""
        ids = self._owned.pop(seq_id, [])
        self.pool.free(ids)
        for rid in [r for r, s in self._pending.items() if s == seq_id]:
            self.cancel(rid)
        return len(ids)

    def owned_blocks(self, seq_id: str) -> list[int]:
        return list(self._owned.get(seq_id, []))

    def sequences(self) -> list[str]:
        return list(self._owned)

    # ---- attention ---------------------------------------------------------------------------------
    def plan_step(self, items: list[HolderSeqStep]) -> StepPlan:
        """Validate a step's items against ownership and build the tensors every layer reuses."""
        bs = self.layout.block_size
        starts, positions, ctx, nblk, rows, slots = [0], [], [], [], [], []
        width = max((len(it.block_ids) for it in items), default=0)
        ids = torch.zeros(len(items), width, dtype=torch.int64)
        idx = torch.zeros(len(items), width, dtype=torch.int64)
        for s, it in enumerate(items):
            owned = set(self._owned.get(it.seq_id, ()))
            if not owned:
                raise NotFound(f"sequence {it.seq_id!r} holds no rBlocks here")
            bad = [b for b in it.block_ids if b not in owned]
            if bad or any(sl // bs not in owned for sl in it.slot_mapping):
                raise InvalidRequest(f"sequence {it.seq_id!r} does not own rBlocks {bad or 'of its slots'}")
            if any(p < 0 or p >= it.context_len for p in it.query_positions):
                raise InvalidRequest(f"query position outside [0, {it.context_len}) for {it.seq_id!r}")
            ids[s, : len(it.block_ids)] = torch.tensor(it.block_ids, dtype=torch.int64)
            idx[s, : len(it.block_indices)] = torch.tensor(it.block_indices, dtype=torch.int64)
            rows.extend(starts[-1] + r for r in it.new_token_rows)
            slots.extend(it.slot_mapping)
            positions.extend(it.query_positions)
            starts.append(starts[-1] + len(it.query_positions))
            ctx.append(it.context_len)
            nblk.append(len(it.block_ids))
        device = self.k_cache.device
        meta = PartialAttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            query_positions=torch.tensor(positions, dtype=torch.int64, device=device),
            block_ids=ids.to(device),
            block_indices=idx.to(device),
            num_blocks=torch.tensor(nblk, dtype=torch.int64, device=device),
            context_lens=torch.tensor(ctx, dtype=torch.int64, device=device),
        )
        return StepPlan(
            meta=meta,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            new_token_rows=torch.tensor(rows, dtype=torch.int64, device=device),
            num_tokens=starts[-1],
        )

    def attend(
        self, layer: int, plan: StepPlan, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V held here, then attention of every query over this holder's rBlocks.

        Args:
            layer: layer index.
            plan: from :meth:`plan_step`.
            query: ``[plan.num_tokens, num_heads, head_dim]``.
            new_key, new_value: ``[len(plan.slot_mapping), num_kv_heads, head_dim]``, only the K/V stored here,
                in slot-mapping order (a caller holding every token's K/V selects ``plan.new_token_rows``).

        Returns:
            ``(partial_out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads] fp32)``, already
            merged over all of each sequence's rBlocks on this holder.
        """
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidRequest(f"layer {layer} out of range [0, {self.layout.num_layers})")
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        write_kv(k_cache, v_cache, plan.slot_mapping, new_key, new_value)
        return self._attention_impl(query, k_cache, v_cache, plan.meta)
