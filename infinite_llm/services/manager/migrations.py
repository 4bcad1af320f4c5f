"""The manager's half of a live migration: reserve on the destination, fenced ledger update, order, settle.

A :class:`~.planner.Move` starts here (DESIGN.md §5, PAPER.md "Managers": the view may be stale, so the
destination is reserved first and the move is dropped if it refuses): one reservation of one rBlock per
moved rBlock on the destination, then one compare-and-swap of the sequence's ledger moving the count from
source to destination (the source entry stays, at 0 if emptied, until the move settles, so a release in
between still frees the source). The compute instance that runs the sequence receives a
:class:`MigrationOrder` with its next heartbeat and moves the rBlocks between its decode steps
(:mod:`infinite_llm.services.compute.migration`); its :class:`MigrationResult` comes back with a later
heartbeat and :meth:`Migrations.settle` puts back in the ledger what did not move and cancels the unused
reservations. Results are self-describing, so a manager that took over leadership settles them too.

Shared rBlocks (prefix caching, issue 13) move with all their readers. The mover's copy lands on the
destination cached under the same hash (the export carries it); its result lists those hashes, and settling
it points the prefix index at the destination, asks the source which other sequences read each moved
rBlock (``BlockReaders``), and gives each of them a *re-attach* order (:meth:`Migrations.reattach`): ledger
shift first, then a reservation on the destination holding a reference to each cached copy for the reader
(``AttachBlocks`` with ``reserve``: the reader's table there is unchanged, so its steps go on), then, between
two of its steps, the reader's instance commits that reservation at the same logical indices, frees its
source references and flips its block table. Once the last reader flipped, the source copy has no reader
left and is parked (free, evicted first). A reader that attached to the source copy after it was asked keeps
reading it (never wrong KV; the block stays until it ends or moves like any other).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import (
    CapacityExhausted,
    InfiniteLLMError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from infinite_llm.core.prefix_cache import HASH_BYTES
from infinite_llm.services.manager.capacity import CapacityView
from infinite_llm.services.manager.ledger import Ledger, LedgerRecord
from infinite_llm.services.manager.placement import BlockServers
from infinite_llm.services.manager.planner import Move
from infinite_llm.services.manager.prefix_index import PrefixIndex
from infinite_llm.services.manager.records import LedgerEntries

log = logging.getLogger(__name__)
# An order older than this (seconds) with no result is given up: twice the attention servers' reservation
# TTL (60 s), past which an import into its reservations cannot succeed anyway.
ORDER_TIMEOUT_S = 120.0
SETTLED_KEPT = 4096  # settled migration ids remembered against late duplicates
# A sequence whose migration moved nothing (its instance refused it: the sequence was preempted or finished,
# no full rBlock was on the source, the destination failed) is not planned again for this long (seconds),
# doubled at each further failure up to the cap; a migration that moves something clears it.
RETRY_BACKOFF_S = 4.0
RETRY_BACKOFF_MAX_S = 64.0
# Readers of moved shared rBlocks re-attached at once (each: a ledger write and a reserving attach)
FOLLOW_CONCURRENCY = 8


@dataclass(frozen=True)
class MigrationOrder:
    """What the compute instance running ``seq_id`` is told: move one rBlock into each reservation; or, for
    a re-attach (``block_indices`` set), commit the one reservation (references to ``dst``'s cached copies)
    at ``block_indices`` and free the source references of those indices."""

    migration_id: int
    seq_id: str
    src: str
    src_address: str
    dst: str
    dst_address: str
    reservation_ids: tuple[int, ...]
    block_indices: tuple[int, ...] = ()
    owner: str = ""  # the compute instance the order is handed to (the only one that may report its result)
    drain: bool = False  # its source is draining: the instance copies at its drain budget

    @property
    def num_blocks(self) -> int:
        return len(self.block_indices) or len(self.reservation_ids)


@dataclass(frozen=True)
class MigrationResult:
    """How an order ended: the first ``num_moved`` of its ``num_blocks`` reservations were committed and
    their source copies freed; ``error`` is '' when all moved."""

    migration_id: int
    seq_id: str
    src: str
    dst: str
    num_blocks: int
    num_moved: int
    bytes_moved: int = 0
    error: str = ""
    cached_hashes: tuple[bytes, ...] = ()  # moved shared rBlocks now cached on dst (their readers follow)
    block_indices: tuple[int, ...] = ()  # a re-attach order's indices (num_moved: 0 or all of them)


def shifted(entries: LedgerEntries, src: str, dst: str, n: int) -> LedgerEntries:
    """``entries`` with ``n`` rBlocks counted on ``dst`` instead of ``src`` (``n < 0``: back); a server
    left at 0 stays listed (its copy may still exist), new servers go last."""
    out = dict(entries)
    out[src] = out.get(src, 0) - n
    out[dst] = out.get(dst, 0) + n
    if out[src] < 0 or out[dst] < 0:
        raise ValueError(f"cannot shift {n} rBlocks {src} -> {dst} in {entries}")
    return list(out.items())


class Migrations:
    """Starts and settles migrations; keeps the orders not yet handed to their instance.

    Args:
        servers, ledger, view: the manager's hands on the attention servers, its ledger and capacity view.
        address_of: ``host:port`` of a live attention server, or ``None``.
    """

    def __init__(
        self,
        servers: BlockServers,
        ledger: Ledger,
        view: CapacityView,
        address_of: Callable[[str], str | None],
        max_txn_attempts: int = 16,
    ) -> None:
        self._servers, self._ledger, self._view, self._address_of = servers, ledger, view, address_of
        self._attempts = max_txn_attempts
        self._ids = itertools.count(1)
        self._orders: dict[str, list[MigrationOrder]] = {}  # owner -> orders not yet handed out
        self.in_flight: dict[int, MigrationOrder] = {}
        self._started: dict[int, float] = {}  # migration id -> time.monotonic() at start
        self._settled: dict[int, None] = {}  # recently settled ids (bounded): a late duplicate changes nothing
        self._backoff: dict[str, tuple[float, int]] = {}  # seq_id -> (time.monotonic() it may move again, failures)
        self.migrations_total = 0  # settled migrations that moved at least one rBlock
        self.blocks_moved = 0
        self.bytes_moved = 0
        self.readers_moved = 0  # block-table entries re-attached to a moved shared rBlock
        # The prefix index (set by the manager): a moved shared rBlock's hash is pointed at its new server.
        self.prefix_index: PrefixIndex | None = None
        self._following: set[asyncio.Task] = set()  # background follows of settled moves (see settle)

    def busy(self, seq_id: str) -> bool:
        """Whether a migration of ``seq_id`` is in flight (one at a time per sequence)."""
        return any(o.seq_id == seq_id for o in self.in_flight.values())

    def backing_off(self, seq_id: str, now: float | None = None) -> bool:
        """Whether ``seq_id``'s last migrations moved nothing and its back-off (:data:`RETRY_BACKOFF_S`,
        doubled per failure) has not run out: the planner leaves it alone until then."""
        entry = self._backoff.get(seq_id)
        return entry is not None and (time.monotonic() if now is None else now) < entry[0]

    def _note_outcome(self, result: MigrationResult) -> None:
        if result.num_moved > 0:
            self._backoff.pop(result.seq_id, None)
            return
        now = time.monotonic()
        failures = self._backoff.get(result.seq_id, (0.0, 0))[1] + 1
        delay = min(RETRY_BACKOFF_S * 2 ** (failures - 1), RETRY_BACKOFF_MAX_S)
        self._backoff[result.seq_id] = (now + delay, failures)
        # bounded: entries whose back-off ran out long ago are forgotten
        for seq_id in [s for s, (until, _) in self._backoff.items() if now - until > RETRY_BACKOFF_MAX_S]:
            del self._backoff[seq_id]

    async def start(self, move: Move, owner: str) -> MigrationOrder | None:
        """Reserve ``move.n_blocks`` on ``move.dst`` and shift them in the ledger; queue the order for ``owner``.

        Returns ``None`` (nothing changed) when the ledger no longer holds that many rBlocks of the sequence
        on the source, an address is unknown, or the destination refuses the reservation (then it is marked
        stale in the view).

        Raises:
            NotLeader: the fence failed (reservations cancelled). Unavailable: etcd failed (same).
        """
        src_address, dst_address = self._address_of(move.src), self._address_of(move.dst)
        record = await self._ledger.read(move.seq_id)
        if src_address is None or dst_address is None or dict(record.entries).get(move.src, 0) < move.n_blocks:
            return None
        held = await self._reserve(move)
        if held is None:
            return None
        try:
            done = await self._swap(record, move.src, move.dst, move.n_blocks)
        except BaseException:
            await self._cancel(move.dst, held)
            raise
        if not done:
            await self._cancel(move.dst, held)
            return None
        order = MigrationOrder(
            next(self._ids),
            move.seq_id,
            move.src,
            src_address,
            move.dst,
            dst_address,
            held,
            owner=owner,
            drain=move.reason == "drain",
        )
        self.in_flight[order.migration_id] = order
        self._started[order.migration_id] = time.monotonic()
        self._orders.setdefault(order.owner, []).append(order)
        log.info("migration %d: %d rBlocks of %s %s -> %s (%s)", order.migration_id, move.n_blocks, move.seq_id,
                 move.src, move.dst, move.reason)  # fmt: skip
        return order

    def check(self, result: MigrationResult, instance_id: str) -> None:
        """Refuse a result that compute instance ``instance_id`` may not report, before anything is settled:
        counts out of range, cache hashes of the wrong size or more than the rBlocks moved, re-attach indices
        that do not fit, or an order in flight whose sequence, servers or size the result contradicts or that
        was handed to another instance. A result of an order not in flight (a new leader's, or one already
        settled) is checked for form only: :meth:`settle` handles it.

        Raises:
            InvalidRequest: what is wrong (``param``: ``migration_results``).
            PermissionDenied: the order in flight belongs to another compute instance.
        """
        problem = ""
        order = self.in_flight.get(result.migration_id)
        if order is not None and order.owner and order.owner != instance_id:
            raise PermissionDenied(
                f"migration {result.migration_id} was ordered from compute instance {order.owner}, not {instance_id}",
                param="migration_results",
            )
        if not 0 <= result.num_moved <= result.num_blocks or result.bytes_moved < 0:
            problem = f"num_moved {result.num_moved} of num_blocks {result.num_blocks}, bytes {result.bytes_moved}"
        elif any(len(h) != HASH_BYTES for h in result.cached_hashes):
            problem = f"cached_hashes must be {HASH_BYTES} bytes each"
        elif len(result.cached_hashes) > result.num_moved:
            problem = f"{len(result.cached_hashes)} cached_hashes for {result.num_moved} rBlocks moved"
        elif result.block_indices and (
            min(result.block_indices) < 0
            or len(result.block_indices) != result.num_blocks
            or result.num_moved not in (0, result.num_blocks)
        ):
            problem = f"block_indices {list(result.block_indices)[:8]} do not fit {result.num_blocks} rBlocks"
        elif order is not None and (order.seq_id, order.src, order.dst, order.num_blocks) != (
            result.seq_id,
            result.src,
            result.dst,
            result.num_blocks,
        ):
            problem = f"it does not match order {order.migration_id} ({order.seq_id} {order.src} -> {order.dst})"
        if problem:
            raise InvalidRequest(f"migration result {result.migration_id}: {problem}", param="migration_results")

    def take_orders(self, owner: str) -> list[MigrationOrder]:
        """The orders for ``owner`` not yet handed out (each is handed out once)."""
        return self._orders.pop(owner, [])

    async def settle(self, result: MigrationResult) -> None:
        """Count what moved; put back in the ledger what did not, cancel its reservations, drop emptied
        source entries. A sequence released meanwhile needs nothing (release freed both servers). A result
        already settled (a duplicate, or one that arrives after :meth:`expire` gave up on it) is ignored."""
        if result.migration_id in self._settled:
            return
        self._settled[result.migration_id] = None
        while len(self._settled) > SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]
        self._started.pop(result.migration_id, None)
        order = self.in_flight.pop(result.migration_id, None)
        for orders in self._orders.values():
            if order in orders:
                orders.remove(order)
        back = result.num_blocks - result.num_moved
        if result.block_indices:
            await self._settle_reattach(result, order, back)
            return
        self._note_outcome(result)
        if order is not None and back > 0:
            await self._cancel(result.dst, order.reservation_ids[result.num_moved :])
        elif order is not None:  # committed on the destination: settles a DrainGuard's count
            await self._cancel(result.dst, order.reservation_ids, quiet=True)
        await self._swap(await self._ledger.read(result.seq_id), result.src, result.dst, -back, drop_empty=True)
        self._view.give_back(result.src, result.num_moved)
        if result.num_moved > 0:
            self.migrations_total += 1
            self.blocks_moved += result.num_moved
            self.bytes_moved += result.bytes_moved
        if result.error:
            log.warning("migration %d of %s ended after %d of %d rBlocks: %s", result.migration_id, result.seq_id,
                        result.num_moved, result.num_blocks, result.error)  # fmt: skip
        if result.cached_hashes and result.num_moved > 0:
            # In the background: a shared prefix may have hundreds of readers, and the heartbeat that carried
            # this result (with its new orders) should not wait for their round trips.
            task = asyncio.get_running_loop().create_task(self._follow_logged(result))
            self._following.add(task)
            task.add_done_callback(self._following.discard)

    async def followed(self) -> None:
        """Wait until the readers of every move settled so far have been followed (their orders queued)."""
        while self._following:
            await asyncio.wait(set(self._following))

    async def stop(self) -> None:
        """Cancel the follows still running (a re-attach not queued leaves its reader on the source copy)."""
        for task in list(self._following):
            task.cancel()
        await asyncio.gather(*self._following, return_exceptions=True)

    async def _follow_logged(self, result: MigrationResult) -> None:
        try:
            await self._follow(result)
        except InfiniteLLMError as e:  # the move is settled; readers not followed stay on the source copy
            log.warning("migration %d: the other readers of its %d shared rBlocks stay on %s: %s",
                        result.migration_id, len(result.cached_hashes), result.src, e)  # fmt: skip
        except Exception:  # noqa: BLE001 - a background task: nobody else would see it
            log.exception("migration %d: following the readers of its shared rBlocks failed", result.migration_id)

    async def _settle_reattach(self, result: MigrationResult, order: MigrationOrder | None, back: int) -> None:
        """A re-attach ended: one that flipped nothing gives its destination references back (its reservation
        cancelled; a manager that took over leaves that to the reservation's expiry) and goes back to the
        source in the ledger, whose copies still serve the reader."""
        if order is not None and back > 0:
            await self._cancel(result.dst, order.reservation_ids, give_back=False)
        await self._swap(await self._ledger.read(result.seq_id), result.src, result.dst, -back, drop_empty=True)
        self.readers_moved += result.num_moved
        if result.error:
            log.warning("re-attach %d of %s ended after %d of %d rBlocks: %s", result.migration_id, result.seq_id,
                        result.num_moved, result.num_blocks, result.error)  # fmt: skip

    async def _follow(self, result: MigrationResult) -> None:
        """A migration moved shared rBlocks, now cached on ``result.dst``: point the index there and give
        every other sequence reading the source copies a re-attach order."""
        hashes = list(result.cached_hashes)
        if self.prefix_index is not None:
            await self.prefix_index.repoint(hashes, result.src, result.dst)
        try:
            found = await self._servers.readers(result.src, hashes)
        except (Unavailable, NotFound, InvalidRequest) as e:
            log.info("readers of %d moved shared rBlocks on %s: %s", len(hashes), result.src, e)
            return
        per_seq: dict[str, list[tuple[int, bytes]]] = {}
        for block_hash, seq_id, index in found:
            if seq_id != result.seq_id:
                per_seq.setdefault(seq_id, []).append((index, block_hash))
        slots = asyncio.Semaphore(FOLLOW_CONCURRENCY)

        async def follow(seq_id: str, blocks: list[tuple[int, bytes]]) -> None:
            async with slots:
                try:
                    await self.reattach(seq_id, result.src, result.dst, sorted(blocks))
                except InfiniteLLMError as e:  # this reader stays on the source copy; the others go on
                    log.warning("re-attach of %s to %s failed: %s", seq_id, result.dst, e)

        await asyncio.gather(*(follow(seq_id, blocks) for seq_id, blocks in per_seq.items()))

    async def reattach(self, seq_id: str, src: str, dst: str, blocks: list[tuple[int, bytes]]) -> MigrationOrder | None:
        """Move ``seq_id``'s references to shared rBlocks from ``src`` to the copies cached on ``dst``:
        ``blocks`` are ``(logical index, hash)``, by index. The ledger shifts first (committed rBlocks follow
        their ledger write), then ``dst`` reserves a reference to the longest prefix of those hashes it
        caches, then the order is queued for the sequence's owner. Returns ``None`` (nothing changed) when
        the sequence has no owner, no longer holds that many rBlocks on ``src``, an address is unknown, or
        ``dst`` caches none of them any more.

        Raises:
            NotLeader, Unavailable (etcd): as :meth:`start` (the reservation is cancelled).
        """
        src_address, dst_address = self._address_of(src), self._address_of(dst)
        record = await self._ledger.read(seq_id)
        held = dict(record.entries).get(src, 0)
        if src_address is None or dst_address is None or not record.owner or held < len(blocks):
            return None
        if not await self._swap(record, src, dst, len(blocks)):
            return None
        reservation = Reservation(0, ())
        try:
            reservation, uncached = await self._servers.reserve_attach(dst, seq_id, [h for _, h in blocks])
            if uncached and self._servers.on_uncached is not None:
                self._servers.on_uncached(dst, uncached)
        except InfiniteLLMError as e:  # unreachable, or refused: nothing held
            log.info("re-attach of %d rBlocks of %s on %s refused: %s", len(blocks), seq_id, dst, e)
        try:
            n = len(reservation.block_ids)
            if n < len(blocks):  # dst evicted some meanwhile: those stay on src
                await self._swap(await self._ledger.read(seq_id), src, dst, n - len(blocks), drop_empty=True)
        except BaseException:
            await self._cancel(dst, (reservation.reservation_id,) if n else (), give_back=False)
            raise
        if n == 0:
            return None
        indices = tuple(i for i, _ in blocks[:n])
        rids = (reservation.reservation_id,)
        order = MigrationOrder(
            next(self._ids), seq_id, src, src_address, dst, dst_address, rids, indices, owner=record.owner
        )
        self.in_flight[order.migration_id] = order
        self._started[order.migration_id] = time.monotonic()
        self._orders.setdefault(order.owner, []).append(order)
        log.info("re-attach %d: %d shared rBlocks of %s %s -> %s", order.migration_id, n, seq_id, src, dst)
        return order

    async def expire(self, now: float | None = None, timeout_s: float = ORDER_TIMEOUT_S) -> int:
        """Settle as failed (nothing moved) the orders started more than ``timeout_s`` seconds ago: their
        instance never reported (the order or its result was lost, or the instance died). No order outlives
        its destination reservations (``RESERVATION_TTL_S`` on the attention server), so none is still
        moving rBlocks by then. Returns how many."""
        now = time.monotonic() if now is None else now
        old = [mid for mid, at in self._started.items() if now - at > timeout_s]
        for mid in old:
            o = self.in_flight[mid]
            result = MigrationResult(mid, o.seq_id, o.src, o.dst, o.num_blocks, 0, 0, "no result in time",
                                     block_indices=o.block_indices)  # fmt: skip
            await self.settle(result)
        return len(old)

    async def _reserve(self, move: Move) -> tuple[int, ...] | None:
        held: list[int] = []
        self._view.take(move.dst, move.n_blocks)
        try:
            for _ in range(move.n_blocks):
                held.append((await self._servers.reserve(move.dst, move.seq_id, 1)).reservation_id)
        except (CapacityExhausted, Unavailable) as e:
            log.info("migration of %s to %s refused: %s", move.seq_id, move.dst, e)
            await self._cancel(move.dst, tuple(held))
            self._view.mark_stale(move.dst)
            return None
        except BaseException:
            await self._cancel(move.dst, tuple(held))
            raise
        return tuple(held)

    async def _cancel(
        self, server_id: str, reservation_ids: tuple[int, ...], quiet: bool = False, give_back: bool = True
    ) -> None:
        """Cancel reservations on ``server_id``; unless ``quiet``, log what could not be cancelled and (with
        ``give_back``; not for a re-attach's references, which took no free rBlock) return them to the view."""
        for rid in reservation_ids:
            try:
                await self._servers.cancel(server_id, rid)
            except (Unavailable, NotFound) as e:  # committed, expired, or the server died
                if not quiet:
                    log.info("cancel reservation %d on %s: %s", rid, server_id, e)
        if not quiet and give_back:
            self._view.give_back(server_id, len(reservation_ids))

    async def _swap(self, record: LedgerRecord, src: str, dst: str, n: int, drop_empty: bool = False) -> bool:
        """Shift ``n`` rBlocks ``src -> dst`` in the sequence's ledger (CAS, retried on conflict); False when
        the sequence is gone or no longer holds them."""
        for _ in range(self._attempts):
            if record.mod_revision == 0:
                return False
            try:
                entries = shifted(record.entries, src, dst, n)
            except ValueError:
                return False
            if drop_empty:
                entries = [(s, k) for s, k in entries if k > 0 or s not in (src, dst)]
            conflict = await self._ledger.swap(record, entries)
            if conflict is None:
                return True
            record = conflict
        raise self._ledger.too_contended(record.seq_id)
