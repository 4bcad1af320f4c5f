"""ServedRManager: the RManager of one attention server, plus what serving it remotely adds.

The servicer's only neighbour below: it keeps the ledger of open reservations (which sequence, which
blocks) so imports can land in them, validates remote input (``validation.py``) before anything changes,
opens a step (``RManager.plan_step``, once) and runs its layers (``RManager.attend``), and reads/writes
whole rBlocks for migration. Pure torch, no gRPC; **not thread-safe**: the servicer calls it from one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import InvalidRequest, NotFound
from infinite_llm.core.ids import check_id
from infinite_llm.core.prefix_cache import HASH_BYTES, BlockHash
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep
from infinite_llm.services.attention.types import HolderStats, ServerStep
from infinite_llm.services.attention.validation import (
    check_layer,
    check_payload,
    check_payload_values,
    check_step_open,
)

RESERVATION_TTL_S = 60.0  # an uncommitted reservation older than this was orphaned (seconds)
# Uncached hashes kept for the manager's next reserve or attach; past this the oldest are dropped (the index
# then keeps a stale entry, which costs one miss: an attach checks this server's own map).
MAX_UNCACHED_KEPT = 1 << 16


class ServedRManager:
    """rBlocks of one server: reservations, steps (open_step / attend_layer), export/import, stats.

    Raises (every method): ``InvalidRequest``, ``NotFound``, ``CapacityExhausted`` as documented by
    ``RManager``; a failed call changes nothing.
    """

    def __init__(
        self,
        rmanager: RManager,
        reservation_ttl_s: float = RESERVATION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rm = rmanager
        self.layout: KVLayout = rmanager.layout
        self._reservations: dict[int, tuple[str, tuple[int, ...]]] = {}  # id -> (seq_id, block ids)
        self._reserved_at: dict[int, float] = {}
        self._staged: dict[int, list[BlockHash]] = {}  # staged import's reservation -> its header hashes
        self.reservation_ttl_s = reservation_ttl_s
        self._clock = clock
        self._uncached: list[BlockHash] = []  # left the prefix cache since the manager was last told
        rmanager.on_uncache = self._note_uncached

    @classmethod
    def with_capacity(cls, kv_memory_bytes: int, layout: KVLayout, device: str = "cpu") -> ServedRManager:
        """A holder with as many rBlocks as fit in ``kv_memory_bytes`` (bytes) on ``device``, computing with
        the kernels dispatcher (Triton on CUDA, the torch reference on CPU)."""
        from infinite_llm.kernels import partial_attention, write_kv

        num_blocks = kv_memory_bytes // layout.bytes_per_block
        rmanager = RManager(num_blocks, layout, device=device, attention_impl=partial_attention, write_kv_impl=write_kv)
        return cls(rmanager)

    # ---- placement (two-phase) -----------------------------------------------------------------------
    def reserve(self, seq_id: str, num_blocks: int) -> Reservation:
        """Phase one: hold ``num_blocks`` (>= 1) free rBlocks for ``seq_id`` (an id by ``core/ids.py``)."""
        check_id("seq_id", seq_id)
        if num_blocks < 1:
            raise InvalidRequest(f"num_blocks must be >= 1, got {num_blocks}")
        self.expire_reservations()
        r = self.rm.reserve(seq_id, num_blocks)
        self._reservations[r.reservation_id] = (seq_id, r.block_ids)
        self._reserved_at[r.reservation_id] = self._clock()
        return r

    def expire_reservations(self) -> int:
        """Cancel reservations older than ``reservation_ttl_s`` seconds; returns how many.

        A reservation is held only between a manager's reserve and commit (milliseconds). One that lives
        longer was orphaned (the manager died in between, or its placement was cancelled mid-transaction)
        and would leak its rBlocks forever.
        """
        cutoff = self._clock() - self.reservation_ttl_s
        stale = [r for r, at in self._reserved_at.items() if at < cutoff]
        for rid in stale:
            self.cancel(rid)
        return len(stale)

    def commit(self, reservation_id: int, block_indices: list[int]) -> tuple[str, list[int], list[BlockHash]]:
        """Phase two: returns ``(seq_id, block_ids, cached)``: the rBlocks now owned by the sequence at logical
        ``block_indices``, and, for a staged import (:meth:`finish_import`), the hashes of its header newly
        cached here under them (else ``[]``). Raises ``NotFound`` for an unknown reservation,
        ``InvalidRequest`` for indices that do not fit it (nothing changes)."""
        seq_id, _ = self._reservation(reservation_id)
        hashes = self._staged.get(reservation_id, [])
        if hashes and len(hashes) != len(block_indices):
            raise InvalidRequest(f"{len(block_indices)} block indices for a staged import of {len(hashes)} rBlocks")
        ids = self.rm.commit(reservation_id, block_indices)
        self._forget(reservation_id)
        cached = [(i, h) for i, h in zip(block_indices, hashes, strict=False) if h]
        if not cached:
            return seq_id, ids, []
        return seq_id, ids, self.cache_blocks(seq_id, [i for i, _ in cached], [h for _, h in cached])

    def cancel(self, reservation_id: int) -> None:
        self._reservation(reservation_id)
        self.rm.cancel(reservation_id)
        self._forget(reservation_id)

    def _forget(self, reservation_id: int) -> None:
        del self._reservations[reservation_id]
        self._reserved_at.pop(reservation_id, None)
        self._staged.pop(reservation_id, None)

    def free_sequence(self, seq_id: str, block_indices: list[int] | None = None, from_index: int | None = None) -> int:
        """Free the sequence's rBlocks and open reservations; returns the rBlocks freed (0 if unknown).
        With ``block_indices`` only those logical rBlocks go (``InvalidRequest`` if one is not held here, or
        for a malformed id). With ``from_index`` only the committed rBlocks at logical index ``>=
        from_index`` go (none held: 0), reservations stay: the manager truncates a sequence this way before
        it places a retried Place again (:meth:`.GlobalManager.place`)."""
        check_id("seq_id", seq_id)
        if from_index is not None:
            if from_index < 0:
                raise InvalidRequest(f"from_block_index must be >= 0, got {from_index}", param="from_block_index")
            return self.rm.free_from(seq_id, from_index)
        if block_indices:
            return self.rm.free_blocks(seq_id, block_indices)
        freed = self.rm.free_sequence(seq_id)
        self._reservations = {r: v for r, v in self._reservations.items() if v[0] != seq_id}
        self._reserved_at = {r: t for r, t in self._reserved_at.items() if r in self._reservations}
        self._staged = {r: h for r, h in self._staged.items() if r in self._reservations}
        return freed

    def num_held(self, seq_id: str) -> int:
        """Committed rBlocks of ``seq_id`` here."""
        return len(self.rm.owned_blocks(seq_id))

    def _reservation(self, reservation_id: int) -> tuple[str, tuple[int, ...]]:
        try:
            return self._reservations[reservation_id]
        except KeyError:
            raise NotFound(f"no reservation {reservation_id}") from None

    # ---- prefix cache (issue 13) ----------------------------------------------------------------------
    def attach_prefix(self, seq_id: str, first_index: int, hashes: list[BlockHash]) -> list[int]:
        """Attach the longest prefix of ``hashes`` cached here to ``seq_id`` at logical indices
        ``first_index ..`` (one reader more each: a parked rBlock is revived, never evicted while read).
        Returns their block ids, in order; fewer than ``hashes`` (maybe none) when one was evicted.
        Raises ``InvalidRequest`` for a malformed id or hash, or an index ``seq_id`` already holds here."""
        check_id("seq_id", seq_id)
        _check_hashes(hashes)
        if first_index < 0:
            raise InvalidRequest(f"first_block_index must be >= 0, got {first_index}")
        n = 0
        while n < len(hashes) and self.rm.cached_block(hashes[n]) is not None:
            n += 1
        if n == 0:
            return []
        return self.rm.attach(seq_id, list(range(first_index, first_index + n)), hashes[:n])

    def reserve_prefix(self, seq_id: str, hashes: list[BlockHash]) -> Reservation:
        """Hold a reference to the cached rBlock of each of the longest prefix of ``hashes`` cached here for
        ``seq_id``, under a reservation (maybe of no block) that :meth:`commit` puts in its table at the
        indices it is given, and :meth:`cancel` or expiry drops. Raises ``InvalidRequest`` for a malformed id
        or hash."""
        check_id("seq_id", seq_id)
        _check_hashes(hashes)
        self.expire_reservations()
        r = self.rm.reserve_cached(seq_id, hashes)
        self._reservations[r.reservation_id] = (seq_id, r.block_ids)
        self._reserved_at[r.reservation_id] = self._clock()
        return r

    def cache_blocks(self, seq_id: str, block_indices: list[int], hashes: list[BlockHash]) -> list[BlockHash]:
        """Mark ``seq_id``'s full rBlocks at ``block_indices`` cached under ``hashes`` (one each); returns
        the hashes newly cached here. Raises ``InvalidRequest`` (nothing changes) for a malformed request or
        an index not held here."""
        check_id("seq_id", seq_id)
        _check_hashes(hashes)
        if len(block_indices) != len(hashes):
            raise InvalidRequest(f"{len(block_indices)} block indices for {len(hashes)} hashes")
        known = {h for h in hashes if self.rm.cached_block(h) is not None}
        self.rm.cache_blocks(seq_id, list(zip(block_indices, hashes, strict=True)))
        return [h for h in dict.fromkeys(hashes) if h not in known and self.rm.cached_block(h) is not None]

    def block_readers(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, str, int]]:
        """``(hash, seq_id, logical index)`` of the sequences reading the cached rBlock of each hash here
        (:meth:`RManager.readers`). Raises ``InvalidRequest`` for a malformed hash."""
        _check_hashes(hashes)
        return self.rm.readers(hashes)

    def take_uncached(self) -> list[BlockHash]:
        """Hashes that left this server's prefix cache since the last call (the manager unindexes them)."""
        out, self._uncached = self._uncached, []
        return out

    def _note_uncached(self, hashes: list[BlockHash]) -> None:
        self._uncached.extend(hashes)
        if len(self._uncached) > MAX_UNCACHED_KEPT:
            del self._uncached[: len(self._uncached) - MAX_UNCACHED_KEPT]

    # ---- attention -----------------------------------------------------------------------------------
    def open_step(self, seqs: list[SeqStep], num_heads: int) -> ServerStep:
        """Plan a step once from ``(seq_id, num_computed_tokens, num_new)`` per sequence; changes nothing."""
        check_step_open(seqs, num_heads, self.layout)
        return ServerStep(self.rm.plan_step(seqs), num_heads)

    def attend_layer(
        self, step: ServerStep, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new K/V held here, then partial attention of its queries over its rBlocks here.

        Args:
            query: ``[num_tokens, num_heads, head_dim]`` (every new token of the step's sequences, in order).
            key, value: ``[num_new_here, num_kv_heads, head_dim]`` (only the rows stored here, in step order).

        Returns:
            ``(partial_out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads] fp32)``.
        """
        check_layer(step, query, key, value, self.layout)
        device = self.rm.device
        return self.rm.attend(layer, step.plan, query.to(device), key.to(device), value.to(device))

    # ---- migration -----------------------------------------------------------------------------------
    def export_blocks(
        self, seq_id: str, block_ids: list[int]
    ) -> tuple[list[int], list[int], list[BlockHash], torch.Tensor]:
        """Snapshot of ``block_ids`` (empty: all, in allocation order) of ``seq_id``.

        Returns ``(block_ids, block_indices, block_hashes, payload)``: the ids, their logical indices, the hash
        each is cached under here (``b""`` for a private block; prefix caching), and the payload
        ``[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` on CPU in the layout dtype,
        contiguous.
        """
        check_id("seq_id", seq_id)
        owned = self.rm.owned_blocks(seq_id)
        if not owned:
            raise NotFound(f"sequence {seq_id!r} holds no rBlocks here")
        ids = list(block_ids) or owned
        stray = sorted(set(ids) - set(owned))
        if stray or len(set(ids)) != len(ids):
            raise InvalidRequest(f"sequence {seq_id!r} cannot export {ids}: not its own or repeated ({stray})")
        index = torch.tensor(ids, dtype=torch.int64, device=self.rm.k_cache.device)
        payload = torch.stack([self.rm.k_cache.index_select(1, index), self.rm.v_cache.index_select(1, index)])
        hashes = [self.rm.hash_of(b) or b"" for b in ids]
        return ids, self.rm.block_indices(seq_id, ids), hashes, payload.cpu()

    def begin_import(
        self, seq_id: str, shape: list[int], dtype: torch.dtype, reservation_ids: list[int]
    ) -> list[Reservation]:
        """Check a transfer's header and return the reservations its data will land in, in payload order.

        ``reservation_ids`` empty (or ``[0]``) reserves the blocks now; otherwise each must be a distinct open
        reservation of ``seq_id``, holding ``shape[2]`` blocks together. Raises ``InvalidRequest`` or
        ``NotFound`` (nothing changes)."""
        check_id("seq_id", seq_id)
        n = check_payload(shape, dtype, self.layout)
        if not reservation_ids or reservation_ids == [0]:
            return [self.reserve(seq_id, n)]
        if len(set(reservation_ids)) != len(reservation_ids):
            raise InvalidRequest(f"reservation ids repeat: {reservation_ids}", param="reservation_ids")
        found = [self._reservation(rid) for rid in reservation_ids]  # (seq_id, block ids) each
        out = [Reservation(rid, ids) for rid, (_, ids) in zip(reservation_ids, found, strict=True)]
        owners = {owner for owner, _ in found}
        held = sum(len(r.block_ids) for r in out)
        if owners != {seq_id} or held != n:
            name = f"reservation {reservation_ids[0]}" if len(out) == 1 else f"reservations {reservation_ids}"
            holders = " and ".join(repr(o) for o in sorted(owners))
            raise InvalidRequest(f"{name} holds {held} rBlocks of {holders}, not {n} of {seq_id!r}")
        return out

    def finish_import(
        self,
        reservations: list[Reservation],
        block_indices: list[int],
        payload: torch.Tensor,
        block_hashes: list[BlockHash] | None = None,
        stage: bool = False,
        values_checked: bool = False,
    ) -> tuple[list[int], list[BlockHash]]:
        """Write ``payload`` (shape as :meth:`export_blocks`) into the reserved rBlocks (the reservations in
        order, as :meth:`begin_import` gave them), then commit them at logical ``block_indices``; a block with
        a hash in ``block_hashes`` (one per block, ``b""`` for none) is then cached under it here, unless this
        server caches that hash already: a shared rBlock moves as a cached one, so its other readers can
        re-attach to it. Returns ``(block ids, hashes newly cached)``.

        With ``stage`` the rBlocks stay reserved (unread) with their hashes: :meth:`commit` publishes and
        caches them later, per reservation (returns ``(reserved block ids, [])``), :meth:`cancel` or expiry
        drops them. ``values_checked``: the caller already ran ``check_payload_values`` on ``payload`` (the
        server does, outside the lock that steps take turns on).

        Raises ``NotFound`` (nothing written) when a reservation ended meanwhile (cancelled, expired, its
        sequence freed: its rBlocks may belong to another sequence by now), ``InvalidRequest`` (nothing
        written) for NaN or inf values, or hashes that do not fit."""
        seq_id = {self._reservation(r.reservation_id)[0] for r in reservations}.pop()
        if not stage:  # the commits below then cannot fail one after another committed
            self.rm.check_indices(seq_id, block_indices)
        hashes = list(block_hashes or [])
        if hashes and len(hashes) != len(block_indices):
            raise InvalidRequest(f"{len(hashes)} block hashes for {len(block_indices)} blocks", param="block_hashes")
        _check_hashes([h for h in hashes if h])
        if not values_checked:
            check_payload_values(payload)
        block_ids = [b for r in reservations for b in r.block_ids]
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.rm.k_cache.device)
        self.rm.k_cache.index_copy_(1, index, payload[0].to(self.rm.k_cache.device))
        self.rm.v_cache.index_copy_(1, index, payload[1].to(self.rm.v_cache.device))
        start, spans = 0, []
        for r in reservations:
            spans.append((r.reservation_id, start, start + len(r.block_ids)))
            start += len(r.block_ids)
        for reservation_id, lo, hi in spans:
            if any(hashes[lo:hi]):
                self._staged[reservation_id] = hashes[lo:hi]  # cached by commit
        if stage:
            return block_ids, []
        ids, cached = [], []
        for reservation_id, lo, hi in spans:
            _, committed, newly = self.commit(reservation_id, block_indices[lo:hi])
            ids.extend(committed)
            cached.extend(newly)
        return ids, cached

    # ---- stats ---------------------------------------------------------------------------------------
    def stats(self) -> HolderStats:
        pool = self.rm.pool
        return HolderStats(
            num_blocks=pool.num_blocks,
            num_free=pool.num_free,
            num_used=pool.num_used,
            num_reserved=pool.num_reserved,
            num_sequences=sum(1 for s in self.rm.sequences() if self.rm.owned_blocks(s)),
            bytes_per_block=self.layout.bytes_per_block,
            num_cached=pool.num_cached,
        )

    def occupancy(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(committed, reserved)``: rBlocks per sequence, committed and in open reservations (what the
        manager's orphan reconciler compares with its ledger). Safe from another thread: each read copies a
        dict in one call, which CPython makes without releasing the GIL; a snapshot may be one call stale."""
        committed = {seq_id: n for seq_id in self.rm.sequences() if (n := len(self.rm.owned_blocks(seq_id)))}
        reserved: dict[str, int] = {}
        for seq_id, ids in dict(self._reservations).values():
            reserved[seq_id] = reserved.get(seq_id, 0) + len(ids)
        return committed, reserved

    def reset(self) -> int:
        """Free every rBlock and reservation (a server fenced out after its lease expired rejoins empty:
        the cluster already counts its KV as lost). Returns the rBlocks freed."""
        freed = sum(self.free_sequence(seq_id) for seq_id in self.rm.sequences())
        for reservation_id in list(self._reservations):
            self.cancel(reservation_id)
        self.rm.clear_cache()  # cached prefixes too: the cluster's index no longer points here
        return freed


def _check_hashes(hashes: list[BlockHash]) -> None:
    bad = [i for i, h in enumerate(hashes) if len(h) != HASH_BYTES]
    if bad:
        raise InvalidRequest(f"block hashes must be {HASH_BYTES} bytes; those at {bad[:8]} are not")
