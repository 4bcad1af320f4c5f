"""Membership: servers register ``members/<server_id>`` under their own lease and keep it alive.

A server's heartbeats (through the manager) refresh its lease; a server that stops vanishes from etcd after
the lease TTL, and a prefix watch removes it from the in-memory member list and capacity view (DESIGN.md
§5). Events are applied only if newer than what is known of the key (by ``mod_revision``), so a late watch
event never undoes a newer registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from infinite_llm.core.errors import InvalidRequest, NotFound, Unavailable
from infinite_llm.services.manager.capacity import CapacityView
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.records import LEADER_KEY, MEMBERS_PREFIX, Member, MemberInfo, check_id
from infinite_llm.state.etcd_store import EtcdStore, KeyValue, Op, PrefixWatch, WatchEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """A server's membership: refresh ``lease_id`` (heartbeat) at least every ``ttl_s`` seconds."""

    server_id: str
    lease_id: int
    ttl_s: int


class Membership:
    """Live members: registration, keep-alive, and a watch-fed view.

    Args:
        store, leadership: etcd and the fence for writes.
        view: the capacity view to keep in step (members added / removed).
        placed_blocks: rBlocks the ledger places on a server (a member enters the view with the rest free).
    """

    def __init__(
        self,
        store: EtcdStore,
        leadership: Leadership,
        view: CapacityView,
        placed_blocks: Callable[[str], int],
    ) -> None:
        self._store = store
        self._leadership = leadership
        self._view = view
        self._placed_blocks = placed_blocks
        self._members: dict[str, Member] = {}
        self._revisions: dict[str, int] = {}  # last applied mod_revision per server id, tombstones too
        self._watch: PrefixWatch | None = None
        self._supervisor: asyncio.Task | None = None
        self.resync_delay_s = 0.5

    async def start(self) -> None:
        """Load the live members from etcd and watch for changes from that revision on.

        If the watch ends (etcd restarted or unreachable), a background task re-reads the members and
        watches again every ``resync_delay_s`` seconds until it succeeds.
        """
        await self._sync()
        self._supervisor = asyncio.create_task(self._keep_watching(), name="member-watch-supervisor")

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        if self._watch is not None:
            await self._watch.cancel()
            self._watch = None

    async def _sync(self) -> None:
        got = await self._store.get_prefix(MEMBERS_PREFIX)
        live = {kv.key[len(MEMBERS_PREFIX) :] for kv in got.items}
        for server_id in set(self._members) - live:
            self._forget(server_id, got.revision)
        for kv in got.items:
            self._apply_put(kv)
        self._watch = await self._store.watch_prefix(MEMBERS_PREFIX, self._on_event, got.revision + 1)

    async def _keep_watching(self) -> None:
        while True:
            await asyncio.wait([self._watch.done])
            log.warning("member watch ended; re-reading members in %.1f s", self.resync_delay_s)
            await asyncio.sleep(self.resync_delay_s)
            with contextlib.suppress(Unavailable):
                await self._sync()

    async def register(self, info: MemberInfo, ttl_s: int) -> Registration:
        """Write ``members/<server_id>`` under a new lease of ``ttl_s`` seconds (fenced).

        Raises:
            NotLeader: this manager does not lead (the new lease is revoked).
        """
        fence = self._leadership.fence()
        lease_id = await self._store.grant_lease(ttl_s)
        key = MEMBERS_PREFIX + info.server_id
        result = await self._store.txn(
            [fence], [Op.put(key, info.to_json(), lease_id), Op.get(key)], [Op.get(LEADER_KEY)]
        )
        if not result.succeeded:
            await self._store.revoke_lease(lease_id)
            self._leadership.check(result.gets[0])
        self._apply_put(result.gets[0])
        return Registration(info.server_id, lease_id, ttl_s)

    async def keep_alive(self, server_id: str) -> int:
        """Refresh the member's lease; returns its TTL in seconds.

        Raises:
            NotFound: no such live member (never registered, or its lease expired: register again).
        """
        member = self.get(server_id)
        ttl = await self._store.refresh_lease(member.lease_id)
        if ttl <= 0:
            self._forget(server_id, self._revisions.get(server_id, 0))
            raise NotFound(f"member {server_id!r} expired; register again")
        return ttl

    async def deregister(self, server_id: str) -> None:
        """Revoke the member's lease: its key goes now. Raises NotFound for an unknown member."""
        member = self.get(server_id)
        try:
            await self._store.revoke_lease(member.lease_id)
        finally:
            self._forget(server_id, self._revisions.get(server_id, 0))

    def get(self, server_id: str) -> Member:
        """Raises NotFound if ``server_id`` is not a live member."""
        member = self._members.get(check_id("server_id", server_id))
        if member is None:
            raise NotFound(f"no live member {server_id!r}")
        return member

    def members(self) -> list[Member]:
        """Live members, by server id."""
        return [self._members[s] for s in sorted(self._members)]

    # ---- view maintenance ------------------------------------------------------------------------
    def _on_event(self, event: WatchEvent) -> None:
        if event.kind == "put":
            self._apply_put(event.kv)
        else:
            self._forget(event.kv.key[len(MEMBERS_PREFIX) :], event.kv.mod_revision)

    def _apply_put(self, kv: KeyValue) -> None:
        server_id = kv.key[len(MEMBERS_PREFIX) :]
        if kv.mod_revision <= self._revisions.get(server_id, 0):
            return
        self._revisions[server_id] = kv.mod_revision
        try:
            info = MemberInfo.from_json(server_id, kv.value)
        except (ValueError, TypeError, InvalidRequest) as e:
            log.error("ignoring malformed member record %s: %s", kv.key, e)
            return
        self._members[server_id] = Member(info, kv.lease)
        self._view.add(server_id, info.capacity_blocks, self._placed_blocks(server_id))
        log.info("member %s at %s: %d rBlocks", server_id, info.address, info.capacity_blocks)

    def _forget(self, server_id: str, revision: int) -> None:
        if revision < self._revisions.get(server_id, 0):
            return
        self._revisions[server_id] = revision
        if self._members.pop(server_id, None) is not None:
            self._view.remove(server_id)
            log.info("member %s gone", server_id)
