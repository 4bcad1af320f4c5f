"""Draining attention servers: placement stops using them, and the manager can tell when they are empty.

A server drains for one of two reasons: the autoscaler is scaling the pool down (:meth:`DrainGuard.set_draining`
names its whole set), or the server itself is stopping (SIGTERM: a rolling update, a node drain, ``kubectl
delete pod``) and says so in its heartbeats (:meth:`DrainGuard.announce`). Either way it drains alike.

:class:`DrainGuard` wraps the manager's :class:`BlockServers` (its hands on the attention servers). A
reservation on a draining server is refused here, without a network call, with ``CapacityExhausted``, which
placement already handles: it marks the server stale and places the share elsewhere (DESIGN.md §5). The
guard also counts reservations in flight per server (reserved, not yet committed or cancelled), because a
placement that reserved before the drain began is written to the ledger only afterwards.

What "drained" means here: the ledger places no rBlock on the server and no reservation is in flight on
it. The manager's planner (:mod:`..rebalance`) reads :attr:`DrainGuard.draining` and migrates the rBlocks
of running sequences away (their compute instances flip their block tables between steps); sequences that
finish release theirs meanwhile, and new ones go elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.services.manager.placement import BlockServers


class DrainGuard:
    """A :class:`BlockServers` that refuses new reservations on draining servers and counts those in flight."""

    def __init__(self, servers: BlockServers) -> None:
        self._servers = servers
        self._scaled_down: frozenset[str] = frozenset()  # the autoscaler's
        self._stopping: set[str] = set()  # servers whose latest heartbeat said they are stopping
        self._draining: frozenset[str] = frozenset()  # the union of both
        self._in_flight: Counter[str] = Counter()
        self._open: set[tuple[str, int]] = set()  # (server_id, reservation_id) reserved, not yet settled

    @property
    def servers(self) -> BlockServers:
        """The wrapped servers."""
        return self._servers

    @property
    def on_uncached(self) -> Callable[[str, list[bytes]], None] | None:
        """The wrapped servers' ``on_uncached`` (evictions they report reach the manager through the guard)."""
        return self._servers.on_uncached

    @on_uncached.setter
    def on_uncached(self, callback: Callable[[str, list[bytes]], None] | None) -> None:
        self._servers.on_uncached = callback

    @property
    def draining(self) -> frozenset[str]:
        """Servers being drained: the autoscaler's set and those that announced they are stopping."""
        return self._draining

    def set_draining(self, server_ids: frozenset[str]) -> None:
        """The autoscaler's drain set: from now on refuse reservations on exactly ``server_ids`` (and on the
        servers that announced they are stopping)."""
        self._scaled_down = frozenset(server_ids)
        self._draining = self._scaled_down | self._stopping

    def announce(self, server_id: str, stopping: bool) -> bool:
        """A server's own word (its heartbeat's ``draining``; a registration says ``False``): drain it while it
        is stopping. Returns True when that changed what the guard knew."""
        if stopping == (server_id in self._stopping):
            return False
        if stopping:
            self._stopping.add(server_id)
        else:
            self._stopping.discard(server_id)
        self._draining = self._scaled_down | self._stopping
        return True

    def in_flight(self, server_id: str) -> int:
        """Reservations on ``server_id`` that were requested and are not yet committed or cancelled."""
        return self._in_flight[server_id]

    def in_flight_counts(self) -> dict[str, int]:
        """A snapshot of :meth:`in_flight` for every server that has any."""
        return dict(self._in_flight)

    async def reserve(self, server_id: str, seq_id: str, n: int) -> Reservation:
        """As ``BlockServers.reserve``; raises CapacityExhausted at once if ``server_id`` is draining."""
        if server_id in self._draining:
            raise CapacityExhausted(f"attention server {server_id!r} is draining")
        self._in_flight[server_id] += 1
        try:
            reservation = await self._servers.reserve(server_id, seq_id, n)
        except BaseException:
            self._done(server_id)
            raise
        self._open.add((server_id, reservation.reservation_id))
        return reservation

    async def commit(self, server_id: str, reservation_id: int, block_indices: list[int]) -> list[int]:
        try:
            return await self._servers.commit(server_id, reservation_id, block_indices)
        finally:
            self._settle(server_id, reservation_id)

    async def cancel(self, server_id: str, reservation_id: int) -> None:
        try:
            await self._servers.cancel(server_id, reservation_id)
        finally:
            self._settle(server_id, reservation_id)

    async def free(self, server_id: str, seq_id: str) -> int:
        return await self._servers.free(server_id, seq_id)

    async def truncate(self, server_id: str, seq_id: str, first_index: int) -> int:
        return await self._servers.truncate(server_id, seq_id, first_index)

    async def attach(
        self, server_id: str, seq_id: str, first_index: int, hashes: list[bytes]
    ) -> tuple[list[int], list[bytes]]:
        """As ``BlockServers.attach``; a draining server attaches nothing (a new reader there would have to
        be migrated away again): the prefix is recomputed elsewhere."""
        if server_id in self._draining:
            return [], []
        return await self._servers.attach(server_id, seq_id, first_index, hashes)

    async def cache(self, server_id: str, seq_id: str, block_indices: list[int], hashes: list[bytes]) -> list[bytes]:
        if server_id in self._draining:
            return []
        return await self._servers.cache(server_id, seq_id, block_indices, hashes)

    async def readers(self, server_id: str, hashes: list[bytes]) -> list[tuple[bytes, str, int]]:
        return await self._servers.readers(server_id, hashes)

    async def reserve_attach(self, server_id: str, seq_id: str, hashes: list[bytes]) -> tuple[Reservation, list[bytes]]:
        """As ``BlockServers.reserve_attach``; a draining server holds nothing new (an empty reservation)."""
        if server_id in self._draining:
            return Reservation(0, ()), []
        return await self._servers.reserve_attach(server_id, seq_id, hashes)

    def _settle(self, server_id: str, reservation_id: int) -> None:
        if (server_id, reservation_id) in self._open:
            self._open.discard((server_id, reservation_id))
            self._done(server_id)

    def _done(self, server_id: str) -> None:
        self._in_flight[server_id] -= 1
        if self._in_flight[server_id] <= 0:
            del self._in_flight[server_id]
