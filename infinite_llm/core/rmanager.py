"""rManager: one holder's KV memory as rBlocks, which sequence owns which, and attention over them.

This is the core of an attention server (PAPER.md "Managers", rManager): an :class:`RBlockPool` for the
bookkeeping, a paged KV tensor per layer for the bytes, the per-sequence ownership, and the fused
"append new K/V into their slots, then partial attention over this holder's rBlocks" of DESIGN.md §3.
The single-process engine runs several of these in one process (one per partition); an attention server
wraps one behind gRPC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infinite_llm.core.attention import PartialAttentionMetadata, partial_attention, write_kv
from infinite_llm.core.block_pool import RBlockPool, Reservation
from infinite_llm.core.errors import FailedPrecondition, InvalidRequest, NotFound
from infinite_llm.core.prefix_cache import BlockHash

PartialAttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
WriteKVFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


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
class SeqStep:
    """One sequence of a step: ``num_new`` tokens from position ``num_computed_tokens`` (tokens with KV).

    This is all a holder is told about a step: it derives block ids, positions and the slot mapping from the
    rBlocks it recorded at commit (DESIGN.md §3: a step is planned once, no block ids travel).
    """

    seq_id: str
    num_computed_tokens: int
    num_new: int
    # rBlocks the compute instance's block table puts on this holder below ceil(context_len / block_size)
    # (None: not checked). A holder that holds a different number refuses the step (FailedPrecondition):
    # attention over rBlocks the table does not know (a leftover of an earlier placement), or without ones it
    # does, would drift silently.
    num_blocks_here: int | None = None

    @property
    def context_len(self) -> int:
        """Tokens whose KV exists after the step."""
        return self.num_computed_tokens + self.num_new


@dataclass(frozen=True)
class StepPlan:
    """One holder's plan of a step, built once by :meth:`RManager.plan_step` and reused by every layer.

    Attributes:
        meta: which keys each query sees (int64 tensors on the KV device).
        slot_mapping: ``[num_new_here]`` int64 slots (``block_id * block_size + offset``) of the new tokens
            whose K/V this holder stores, in step order.
        num_tokens: query rows of the plan (every new token of each planned sequence, in step order).
        seq_versions: ``(seq_id, version)`` of each sequence at planning; a free in between voids the plan.
        max_query_len: the most new tokens of one sequence (decode: 1; 0 for an empty plan), handed to the
            kernel so that it reads no query length back from the device (a host sync per layer on a GPU).
    """

    meta: PartialAttentionMetadata
    slot_mapping: torch.Tensor
    num_tokens: int
    seq_versions: tuple[tuple[str, int], ...]
    max_query_len: int = 0

    @property
    def num_new_here(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class PlanRows:
    """One holder's share of a step as host lists, one entry per sequence of the step, in step order.

    Attributes:
        block_ids: per sequence, the physical ids of its rBlocks here that the step reads.
        block_indices: per sequence, the logical index of each of those rBlocks.
        slots: per sequence, the slots (``block_id * block_size + offset``) of its new tokens stored here.
        context_lens: per sequence, tokens with KV after the step.
        seq_versions: ``(seq_id, version)`` at planning (see :class:`StepPlan`).
    """

    block_ids: list[list[int]]
    block_indices: list[list[int]]
    slots: list[list[int]]
    context_lens: list[int]
    seq_versions: tuple[tuple[str, int], ...]


class RManager:
    """KV memory of one holder: pool + paged KV ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

    Each committed rBlock is recorded with its logical index in its sequence's block table (entry ``i``
    covers tokens ``[i*block_size, (i+1)*block_size)``), so a step needs only ``(seq_id,
    num_computed_tokens, num_new)`` per sequence (:meth:`plan_step`).

    Raises:
        CapacityExhausted: not enough free rBlocks (nothing changes).
        NotFound: an unknown sequence or reservation.
        InvalidRequest: a logical index given twice, bad step counts, tensors that do not fit the plan.
    """

    def __init__(
        self,
        num_blocks: int,
        layout: KVLayout,
        device: torch.device | str = "cpu",
        attention_impl: PartialAttentionFn = partial_attention,
        write_kv_impl: WriteKVFn = write_kv,
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.pool = RBlockPool(num_blocks, on_evict=self._forget_hashes)
        shape = (layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self._attention_impl = attention_impl
        self._write_kv_impl = write_kv_impl
        self._owned: dict[str, dict[int, int]] = {}  # seq_id -> {logical index: block id}, in commit order
        self._pending: dict[int, str] = {}
        self._versions: dict[str, int] = {}  # bumped when a sequence's blocks are freed: voids older plans
        self._block_of_hash: dict[BlockHash, int] = {}  # prefix cache: full rBlocks here, by hash
        self._hash_of_block: dict[int, BlockHash] = {}
        self.on_uncache: Callable[[list[BlockHash]], None] | None = None  # told hashes evicted or cleared here

    # ---- ownership ---------------------------------------------------------------------------------
    def allocate(self, seq_id: str, block_indices: Sequence[int]) -> list[int]:
        """Allocate one rBlock per logical index in ``block_indices`` to ``seq_id``; returns the block ids."""
        self.check_indices(seq_id, block_indices)
        ids = self.pool.allocate(len(block_indices))
        self._record(seq_id, block_indices, ids)
        return ids

    def reserve(self, seq_id: str, n: int) -> Reservation:
        """Phase one of a remote placement: hold ``n`` blocks for ``seq_id`` without publishing them."""
        r = self.pool.reserve(n)
        self._pending[r.reservation_id] = seq_id
        return r

    def commit(self, reservation_id: int, block_indices: Sequence[int]) -> list[int]:
        """Phase two: the reserved blocks now belong to their sequence at logical ``block_indices``
        (one per block, in reservation order)."""
        seq_id = self._pending.get(reservation_id)
        if seq_id is None:
            raise NotFound(f"no reservation {reservation_id}")
        if len(block_indices) != len(self.pool.reserved_ids(reservation_id)):
            raise InvalidRequest(
                f"reservation {reservation_id} holds {len(self.pool.reserved_ids(reservation_id))} rBlocks, "
                f"got {len(block_indices)} block indices"
            )
        self.check_indices(seq_id, block_indices)
        ids = self.pool.commit(reservation_id)
        del self._pending[reservation_id]
        self._record(seq_id, block_indices, ids)
        return ids

    def check_indices(self, seq_id: str, block_indices: Sequence[int]) -> None:
        """Raises ``InvalidRequest`` unless ``block_indices`` are distinct, >= 0 and none held by ``seq_id``."""
        owned = self._owned.get(seq_id, {})
        if any(i < 0 for i in block_indices) or len(set(block_indices)) != len(block_indices):
            raise InvalidRequest(f"block indices {list(block_indices)[:8]} of {seq_id!r} must be distinct and >= 0")
        taken = [i for i in block_indices if i in owned]
        if taken:
            raise InvalidRequest(f"sequence {seq_id!r} already holds logical blocks {taken[:8]} here")

    def _record(self, seq_id: str, block_indices: Sequence[int], ids: Sequence[int]) -> None:
        owned = self._owned.setdefault(seq_id, {})
        owned.update(zip(block_indices, ids, strict=True))
        self._versions.setdefault(seq_id, 0)

    def cancel(self, reservation_id: int) -> None:
        self.pool.cancel(reservation_id)
        self._pending.pop(reservation_id, None)

    def free_sequence(self, seq_id: str) -> int:
        """Free every rBlock (and pending reservation) of ``seq_id``; returns how many blocks were freed."""
        ids = list(self._owned.pop(seq_id, {}).values())
        self.pool.free(ids)
        if seq_id in self._versions:
            self._versions[seq_id] += 1
        for rid in [r for r, s in self._pending.items() if s == seq_id]:
            self.cancel(rid)
        return len(ids)

    def free_blocks(self, seq_id: str, block_indices: Sequence[int]) -> int:
        """Free the rBlocks of ``seq_id`` at logical ``block_indices`` (a migration's source copy after the
        flip); returns how many. Raises ``InvalidRequest`` (nothing freed) for an index not held here."""
        owned = self._owned.get(seq_id, {})
        missing = sorted(set(block_indices) - set(owned))
        if missing or len(set(block_indices)) != len(block_indices):
            bad = missing[:8] or list(block_indices)[:8]
            raise InvalidRequest(f"sequence {seq_id!r} cannot free logical rBlocks {bad} here (not held, or repeated)")
        self.pool.free([owned.pop(i) for i in block_indices])
        self._versions[seq_id] += 1  # plans made before no longer match the table
        if not owned:
            del self._owned[seq_id]
        return len(block_indices)

    def owned_blocks(self, seq_id: str) -> list[int]:
        """Block ids of ``seq_id`` here, in commit order."""
        return list(self._owned.get(seq_id, {}).values())

    def free_from(self, seq_id: str, first_index: int) -> int:
        """Free ``seq_id``'s rBlocks at logical index ``>= first_index`` (none held: nothing); returns how
        many. A retried Place truncates a sequence this way (``GlobalManager.place``)."""
        beyond = sorted(i for i in self._owned.get(seq_id, {}) if i >= first_index)
        return self.free_blocks(seq_id, beyond) if beyond else 0

    def block_indices(self, seq_id: str, block_ids: Sequence[int]) -> list[int]:
        """Logical index of each of ``seq_id``'s ``block_ids`` (for export)."""
        index_of = {b: i for i, b in self._owned.get(seq_id, {}).items()}
        return [index_of[b] for b in block_ids]

    def sequences(self) -> list[str]:
        return list(self._owned)

    # ---- prefix cache --------------------------------------------------------------------------------
    def cache_blocks(self, seq_id: str, entries: Sequence[tuple[int, BlockHash]]) -> list[int]:
        """Index full rBlocks of ``seq_id`` by hash: ``entries`` are ``(logical index, hash)``. A hash
        already indexed here, or a block already cached, is skipped. Returns the block ids newly cached.
        Raises ``InvalidRequest`` (nothing changes) for an index ``seq_id`` does not hold here."""
        owned = self._owned.get(seq_id, {})
        missing = [i for i, _ in entries if i not in owned]
        if missing:
            raise InvalidRequest(f"sequence {seq_id!r} holds no rBlocks at logical {missing[:8]} here to cache")
        added = []
        for i, h in entries:
            block = owned[i]
            if h in self._block_of_hash or self.pool.is_cached(block):
                continue
            self.pool.mark_cached(block)
            self._block_of_hash[h], self._hash_of_block[block] = block, h
            added.append(block)
        return added

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block id here whose KV ``block_hash`` names, or ``None``."""
        return self._block_of_hash.get(block_hash)

    def attach(self, seq_id: str, block_indices: Sequence[int], hashes: Sequence[BlockHash]) -> list[int]:
        """A prefix-cache hit: the cached rBlocks named by ``hashes`` join ``seq_id``'s table at logical
        ``block_indices`` (one reader more each; they are read, never written). Returns their block ids.
        Raises ``NotFound`` (nothing changes) if a hash is not cached here (evicted meanwhile)."""
        self.check_indices(seq_id, block_indices)
        ids = [self._block_of_hash.get(h) for h in hashes]
        if len(ids) != len(block_indices) or None in ids:
            raise NotFound(f"{ids.count(None)} of {len(hashes)} prefix blocks of {seq_id!r} are no longer cached here")
        for b in ids:
            self.pool.revive(b)
        self._record(seq_id, block_indices, ids)
        return ids  # type: ignore[return-value]

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The hash block ``block_id`` is cached under here, or ``None`` (a private block)."""
        return self._hash_of_block.get(block_id)

    def readers(self, hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, str, int]]:
        """``(hash, seq_id, logical index)`` of every sequence reading the cached rBlock of each of ``hashes``
        here, grouped by hash in the given order (a hash not cached here has none)."""
        wanted = {b: h for h in dict.fromkeys(hashes) if (b := self._block_of_hash.get(h)) is not None}
        found: dict[BlockHash, list[tuple[BlockHash, str, int]]] = {h: [] for h in wanted.values()}
        for seq_id, owned in self._owned.items():
            for index, block in owned.items():
                if block in wanted:
                    found[wanted[block]].append((wanted[block], seq_id, index))
        return [r for h in found for r in found[h]]

    def reserve_cached(self, seq_id: str, hashes: Sequence[BlockHash]) -> Reservation:
        """A reference to the cached rBlock of each of the longest prefix of ``hashes`` cached here, held for
        ``seq_id`` under a reservation (maybe of no block): :meth:`commit` puts them in its table at the
        logical indices it is given, :meth:`cancel` drops them. Until then the sequence's table here is
        unchanged, so its steps go on (a migration's re-attach)."""
        ids: list[int] = []
        for h in hashes:
            b = self._block_of_hash.get(h)
            if b is None:
                break
            ids.append(b)
        r = self.pool.reserve_cached(ids)
        self._pending[r.reservation_id] = seq_id
        return r

    def clear_cache(self) -> int:
        """Drop every hash: cached rBlocks with no reader become free, read ones private. Returns how many."""
        return len(self.pool.evict_cached())

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    def _forget_hashes(self, block_ids: list[int]) -> None:
        """The pool evicted (or uncached) these blocks: they leave the index in the same call."""
        gone = [h for b in block_ids if (h := self._hash_of_block.pop(b, None)) is not None]
        for h in gone:
            del self._block_of_hash[h]
        if gone and self.on_uncache is not None:
            self.on_uncache(gone)

    # ---- attention ---------------------------------------------------------------------------------
    def plan_rows(self, seqs: Sequence[SeqStep]) -> PlanRows:
        """What this holder contributes to a step, per sequence, as host lists (checked; nothing changes).

        Each sequence's keys are its rBlocks here with logical index below ``ceil(context_len /
        block_size)``; its new tokens whose rBlock is here get slots. A sequence with no such rBlock is an
        empty part (``lse = -inf``). Raises ``NotFound`` for a sequence that holds nothing here,
        ``InvalidRequest`` for bad counts or a sequence listed twice, ``FailedPrecondition`` when a sequence
        holds another number of those rBlocks here than its ``num_blocks_here`` says.
        """
        bs = self.layout.block_size
        seen: set[str] = set()
        for s in seqs:
            if s.seq_id in seen:
                raise InvalidRequest(f"sequence id {s.seq_id!r} appears twice in one step")
            seen.add(s.seq_id)
        ids: list[list[int]] = []
        idx: list[list[int]] = []
        slots: list[list[int]] = []
        for s in seqs:
            owned = self._owned.get(s.seq_id)
            if not owned:
                raise NotFound(f"sequence {s.seq_id!r} holds no rBlocks here")
            if s.num_computed_tokens < 0 or s.num_new < 1:
                raise InvalidRequest(
                    f"sequence {s.seq_id!r}: num_computed_tokens {s.num_computed_tokens} must be >= 0 and "
                    f"num_new {s.num_new} >= 1"
                )
            num_blocks = -(-s.context_len // bs)
            visible = [(i, b) for i, b in owned.items() if i < num_blocks]
            if s.num_blocks_here is not None and len(visible) != s.num_blocks_here:
                raise FailedPrecondition(
                    f"sequence {s.seq_id!r} holds rBlocks {sorted(i for i, _ in visible)[:8]} of its first "
                    f"{num_blocks} here, its block table puts {s.num_blocks_here} here: refusing a step that "
                    f"would attend over other KV than the sequence's"
                )
            idx.append([i for i, _ in visible])
            ids.append([b for _, b in visible])
            seq_slots = []
            for pos in range(s.num_computed_tokens, s.context_len):
                block = owned.get(pos // bs)
                if block is not None:
                    seq_slots.append(block * bs + pos % bs)
            if seq_slots and (shared := {b // bs for b in seq_slots} & self._hash_of_block.keys()):
                raise InvalidRequest(f"sequence {s.seq_id!r} would write into cached rBlocks {sorted(shared)[:4]}")
            slots.append(seq_slots)
        versions = tuple((s.seq_id, self._versions[s.seq_id]) for s in seqs)
        return PlanRows(ids, idx, slots, [s.context_len for s in seqs], versions)

    def plan_step(self, seqs: Sequence[SeqStep]) -> StepPlan:
        """Build the tensors every layer of a step reuses, from what this holder recorded at commit.

        Each sequence's queries are all its ``num_new`` tokens (every holder of its context sees every
        query); keys and slots as :meth:`plan_rows` (which raises for bad steps).
        """
        rows = self.plan_rows(seqs)
        starts, positions = [0], []
        for s in seqs:
            positions.extend(range(s.num_computed_tokens, s.context_len))
            starts.append(starts[-1] + s.num_new)
        slots = [slot for seq_slots in rows.slots for slot in seq_slots]
        return StepPlan(
            meta=self._metadata(starts, positions, rows.context_lens, rows.block_ids, rows.block_indices),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_tokens=starts[-1],
            seq_versions=rows.seq_versions,
            max_query_len=max((s.num_new for s in seqs), default=0),
        )

    def _metadata(self, starts, positions, ctx, ids, idx) -> PartialAttentionMetadata:  # noqa: ANN001
        """Padded ``[num_seqs, max_blocks]`` block lists and the rest as int64 tensors on the KV device."""
        width = max((len(r) for r in ids), default=0)
        pad = [[0] * (width - len(r)) for r in ids]

        def tensor(x):  # noqa: ANN001, ANN202
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        return PartialAttentionMetadata(
            query_start_loc=tensor(starts),
            query_positions=tensor(positions),
            block_ids=tensor([r + p for r, p in zip(ids, pad, strict=True)]).view(len(ids), width),
            block_indices=tensor([r + p for r, p in zip(idx, pad, strict=True)]).view(len(idx), width),
            num_blocks=tensor([len(r) for r in ids]),
            context_lens=tensor(ctx),
        )

    def attend(
        self, layer: int, plan: StepPlan, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V held here, then attention of every query over this holder's rBlocks.

        Args:
            layer: layer index.
            plan: from :meth:`plan_step`; refused (``NotFound``) if one of its sequences was freed since.
            query: ``[plan.num_tokens, num_heads, head_dim]`` on the KV device.
            new_key, new_value: ``[plan.num_new_here, num_kv_heads, head_dim]``: only the K/V stored here, in
                step order.

        Returns:
            ``(partial_out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads] fp32)``, already
            merged over all of each sequence's rBlocks on this holder.
        """
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidRequest(f"layer {layer} out of range [0, {self.layout.num_layers})")
        if query.shape[0] != plan.num_tokens or new_key.shape[0] != plan.num_new_here:
            raise InvalidRequest(
                f"the step planned {plan.num_tokens} queries and {plan.num_new_here} new K/V rows here, "
                f"got {query.shape[0]} and {new_key.shape[0]}"
            )
        stale = [s for s, v in plan.seq_versions if self._versions.get(s) != v or s not in self._owned]
        if stale:
            raise NotFound(f"sequences {stale[:4]} were freed during the step")
        hint = plan.max_query_len or None  # an empty plan: the kernel returns before reading it
        return self.attend_planned(layer, plan.meta, plan.slot_mapping, query, new_key, new_value, hint)

    def attend_planned(
        self,
        layer: int,
        meta: PartialAttentionMetadata,
        slot_mapping: torch.Tensor,
        query: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        max_query_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` without its checks, on metadata the caller built from this step's plans.

        For the CUDA-graph decode (``core/decode_graphs.py``): no host sync and no Python state is read, so
        the call can be captured and replayed. ``slot_mapping [num_new]`` may hold ``-1`` for rows whose
        K/V is not stored here (padding, or another holder's token); ``new_key, new_value`` then have one row
        per query. ``max_query_len`` (decode: 1) spares the kernel launcher its host sync.
        """
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        self._write_kv_impl(k_cache, v_cache, slot_mapping, new_key, new_value)
        return self._attention_impl(query, k_cache, v_cache, meta, max_query_len=max_query_len)
