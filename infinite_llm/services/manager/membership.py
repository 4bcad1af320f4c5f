"""Membership: members register ``<prefix><id>`` under their own lease and keep it alive.

A member's heartbeats (through the manager) refresh its lease. The leading manager removes a member that has
been silent for its TTL (a fenced delete of its key), and a prefix watch removes it from every manager's
in-memory member list (DESIGN.md §5). The etcd lease itself lives longer, by ``lease_grace_s``: it is what
removes a member when no manager leads, and the grace spans a failover, so a crash of the leader does not
take every member with it (their heartbeats cannot reach a manager until a standby leads, which takes the
leader's session lease; with leases of the same length they lapsed together). A manager that starts leading,
or that itself stalled, gives every member a full TTL from then to be heard. Events are applied only if
newer than what is known of the key (by ``mod_revision``), so a late watch event never undoes a newer
registration. :class:`LeasedMembers` is that mechanism for any record; :class:`Membership`
is the attention servers' (``members/``, kept in step with the capacity view) and the compute instances use
it under ``computes/`` (:mod:`.computes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from infinite_llm.core.errors import InvalidRequest, NotFound, PermissionDenied, Unavailable
from infinite_llm.services.manager.capacity import CapacityView
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.records import LEADER_KEY, MEMBERS_PREFIX, InfoT, Member, MemberInfo, check_id
from infinite_llm.state.etcd_store import Compare, EtcdStore, KeyValue, Op, PrefixWatch, WatchEvent

log = logging.getLogger(__name__)

REAP_TICK_S = 0.25  # how often the leader looks for silent members (seconds)
# A reap tick this much later than due means this manager could not hear anyone meanwhile (a stall, a long
# pause of its event loop): every member then gets a full TTL from the tick, as after taking the lead.
STALL_S = 1.0
REMOVE_RETRY_S = 1.0  # a removal etcd failed is tried again after this long (seconds)


def check_caller_address(what: str, registered: str, address: str, param: str) -> None:
    """Raises ``PermissionDenied`` when a live member's heartbeat or deregistration names ``address`` and it is
    not the one it registered (``registered``): every member of a role shares one certificate, and a second
    process under a live id must not speak for it. ``address`` '' (an older member that does not tell) is not
    checked. ``what``: the member as the error names it (``attention server 'a'``)."""
    if address and registered != address:
        raise PermissionDenied(
            f"{what} is registered at {registered}, not {address}: another process under the same id", param=param
        )


@dataclass(frozen=True)
class Registration:
    """A member's registration: heartbeat at least every ``ttl_s`` seconds (the leader removes a member silent
    that long). ``server_id`` is the member's id (a compute instance's ``instance_id``); ``lease_id`` its
    etcd lease, of ``ttl_s`` plus the manager's ``lease_grace_s``."""

    server_id: str
    lease_id: int
    ttl_s: int


class LeasedMembers(Generic[InfoT]):
    """Live members under ``prefix``: registration, keep-alive, and a watch-fed view.

    Args:
        store, leadership: etcd and the fence for writes.
        prefix: their keys' prefix (``members/``, ``computes/``).
        id_param: the name of their id in errors (``server_id``, ``instance_id``).
        id_of: a record's id (the last segment of its key).
        decode: ``(id, value) -> record``; raises ``ValueError``/``TypeError``/``InvalidRequest`` on a bad one.
            ``record.to_json()`` is the value ``register`` writes.
        on_put / on_gone: told of a member that appeared (or changed) / vanished, e.g. to keep a view in step.
        default_ttl_s: the silence (seconds) after which the leader removes a member it did not register
            itself (one registered through an earlier leader); a member registered here keeps its own.
        lease_grace_s: how much longer than its TTL a member's etcd lease lasts (seconds): the removal of
            a silent member while no manager leads. Give it more than the leaders' session lease.
        kind: what a member is, in logs ("attention server", "compute instance").
    """

    def __init__(
        self,
        store: EtcdStore,
        leadership: Leadership,
        prefix: str,
        id_param: str,
        id_of: Callable[[InfoT], str],
        decode: Callable[[str, bytes], InfoT],
        on_put: Callable[[str, InfoT], None] = lambda _id, _info: None,
        on_gone: Callable[[str], None] = lambda _id: None,
        default_ttl_s: int = 10,
        lease_grace_s: int = 0,
        kind: str = "member",
    ) -> None:
        self._store = store
        self.kind = kind
        self._leadership = leadership
        self.prefix, self.id_param = prefix, id_param
        self._id_of, self._decode, self._on_put, self._on_gone = id_of, decode, on_put, on_gone
        self.default_ttl_s, self.lease_grace_s = default_ttl_s, lease_grace_s
        self._members: dict[str, Member[InfoT]] = {}
        self._revisions: dict[str, int] = {}  # last applied mod_revision per member id, tombstones too
        self._ttls: dict[str, int] = {}  # the TTL (seconds) each member registered here asked for
        self._heard: dict[str, float] = {}  # time.monotonic() a member was last heard of (live members only)
        self._retry_at: dict[str, float] = {}  # time.monotonic() before which a failed removal is not retried
        self._watch: PrefixWatch | None = None
        self._tasks: list[asyncio.Task] = []
        self.resync_delay_s = 0.5

    async def start(self) -> None:
        """Load the live members from etcd and watch for changes from that revision on.

        If the watch ends (etcd restarted or unreachable), a background task re-reads the members and
        watches again every ``resync_delay_s`` seconds until it succeeds. Another removes silent members
        while this manager leads.
        """
        await self._sync()
        self._tasks = [
            asyncio.create_task(self._keep_watching(), name=f"watch-{self.prefix}"),
            asyncio.create_task(self._remove_silent(), name=f"silent-{self.prefix}"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._watch is not None:
            await self._watch.cancel()
            self._watch = None

    async def _sync(self) -> None:
        got = await self._store.get_prefix(self.prefix)
        live = {kv.key[len(self.prefix) :] for kv in got.items}
        for member_id in set(self._members) - live:
            self._forget(member_id, got.revision)
        for kv in got.items:
            self._apply_put(kv)
        self._watch = await self._store.watch_prefix(self.prefix, self._on_event, got.revision + 1)

    async def _keep_watching(self) -> None:
        while True:
            await asyncio.wait([self._watch.done])
            log.warning("watch of %s ended; re-reading in %.1f s", self.prefix, self.resync_delay_s)
            await asyncio.sleep(self.resync_delay_s)
            with contextlib.suppress(Unavailable):
                await self._sync()

    async def register(self, info: InfoT, ttl_s: int) -> Registration:
        """Write ``<prefix><id>`` = ``info`` under a new lease (fenced); the member must then heartbeat at
        least every ``ttl_s`` seconds. The lease lasts ``ttl_s + lease_grace_s``.

        Raises:
            NotLeader: this manager does not lead (the new lease is revoked).
        """
        fence = self._leadership.fence()
        member_id = self._id_of(info)
        lease_id = await self._store.grant_lease(ttl_s + self.lease_grace_s)
        key = self.prefix + member_id
        result = await self._store.txn(
            [fence], [Op.put(key, info.to_json(), lease_id), Op.get(key)], [Op.get(LEADER_KEY)]
        )
        if not result.succeeded:
            await self._store.revoke_lease(lease_id)
            self._leadership.check(result.gets[0])
        self._ttls[member_id] = ttl_s
        self._apply_put(result.gets[0])
        self._heard[member_id] = time.monotonic()
        return Registration(member_id, lease_id, ttl_s)

    async def keep_alive(self, member_id: str) -> int:
        """Refresh the member's lease; returns its TTL in seconds (heartbeat at least this often).

        Raises:
            NotFound: no such live member (never registered, removed as silent, or its lease expired:
                register again).
        """
        member = self.get(member_id)
        self._heard[member_id] = time.monotonic()  # heard, even if etcd cannot refresh its lease now
        if await self._store.refresh_lease(member.lease_id) <= 0:
            self._forget(member_id, self._revisions.get(member_id, 0))
            raise NotFound(f"member {member_id!r} expired; register again")
        return self._ttl(member_id)

    def _ttl(self, member_id: str) -> int:
        return self._ttls.get(member_id, self.default_ttl_s)

    def ttl_of(self, member_id: str) -> int:
        """The member's lease TTL in seconds (its heartbeats come every third of it)."""
        return self._ttl(member_id)

    async def _remove_silent(self) -> None:
        """While this manager leads, remove every member not heard of for its TTL. A new term, or a stall
        of this manager, first gives every member a full TTL from then."""
        term, due, reset_at = None, time.monotonic() + REAP_TICK_S, 0.0
        while True:
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            now = time.monotonic()
            stalled, due = now - due > STALL_S, now + REAP_TICK_S
            since = self._leadership.leading_since
            if since is None or since != term or stalled:
                term, reset_at = since, now
                self._heard = dict.fromkeys(self._members, now)
                continue
            for member_id, heard in list(self._heard.items()):
                if now - heard > self._ttl(member_id) and now >= self._retry_at.get(member_id, 0.0):
                    try:
                        await self._remove(member_id, now - heard, heard == reset_at)
                    except Exception:  # noqa: BLE001 - the task must outlive any one failure
                        log.exception("removing silent %s %s failed", self.kind, member_id)

    async def _remove(self, member_id: str, silent_s: float, heard_reset: bool) -> None:
        """Delete a silent member's key (fenced, and only the registration that went silent), then revoke
        its lease. Leaves it for the next tick when etcd fails or this manager stopped leading."""
        member, key = self._members.get(member_id), self.prefix + member_id
        if member is None:
            return
        since = "this manager took the lead or stalled" if heard_reset else "its last heartbeat"
        log.warning("%s %s not heard from for %.1f s (since %s): removing it", self.kind, member_id, silent_s, since)
        try:
            result = await self._store.txn(
                [self._leadership.fence(), Compare.mod_revision(key, self._revisions[member_id])],
                [Op.delete(key)],
                [Op.get(LEADER_KEY)],
            )
            if not result.succeeded:
                self._leadership.check(result.gets[0])  # else it registered again meanwhile
                return
        except Unavailable as e:  # NotLeader too
            log.warning("could not remove silent %s %s: %s; retrying in %g s", self.kind, member_id, e, REMOVE_RETRY_S)
            self._retry_at[member_id] = time.monotonic() + REMOVE_RETRY_S
            return
        self._forget(member_id, result.revision)
        with contextlib.suppress(NotFound, Unavailable):  # it lapses after its TTL anyway
            await self._store.revoke_lease(member.lease_id)

    async def deregister(self, member_id: str) -> None:
        """Revoke the member's lease: its key goes now. Raises NotFound for an unknown member."""
        member = self.get(member_id)
        try:
            await self._store.revoke_lease(member.lease_id)
        finally:
            self._forget(member_id, self._revisions.get(member_id, 0))

    def get(self, member_id: str) -> Member[InfoT]:
        """Raises InvalidRequest for a malformed id, NotFound if ``member_id`` is not a live member."""
        member = self._members.get(check_id(self.id_param, member_id))
        if member is None:
            raise NotFound(f"no live member {member_id!r}", param=self.id_param)
        return member

    def members(self) -> list[Member[InfoT]]:
        """Live members, by id."""
        return [self._members[s] for s in sorted(self._members)]

    # ---- view maintenance ------------------------------------------------------------------------
    def _on_event(self, event: WatchEvent) -> None:
        if event.kind == "put":
            self._apply_put(event.kv)
        else:
            self._forget(event.kv.key[len(self.prefix) :], event.kv.mod_revision)

    def _apply_put(self, kv: KeyValue) -> None:
        member_id = kv.key[len(self.prefix) :]
        if kv.mod_revision <= self._revisions.get(member_id, 0):
            return
        self._revisions[member_id] = kv.mod_revision
        try:
            info = self._decode(member_id, kv.value)
        except (ValueError, TypeError, InvalidRequest) as e:
            log.error("ignoring malformed member record %s: %s", kv.key, e)
            return
        self._members[member_id] = Member(info, kv.lease)
        self._heard.setdefault(member_id, time.monotonic())
        self._on_put(member_id, info)

    def _forget(self, member_id: str, revision: int) -> None:
        if revision < self._revisions.get(member_id, 0):
            return
        self._revisions[member_id] = revision
        for per_member in (self._heard, self._ttls, self._retry_at):
            per_member.pop(member_id, None)
        if self._members.pop(member_id, None) is not None:
            self._on_gone(member_id)
            log.info("%s %s gone", self.kind, member_id)


class Membership(LeasedMembers[MemberInfo]):
    """The attention servers (``members/``), kept in step with the capacity view.

    Args:
        store, leadership: etcd and the fence for writes.
        view: the capacity view to keep in step (members added / removed).
        placed_blocks: rBlocks the ledger places on a server (a member enters the view with the rest free).
        on_gone: told of a server whose key vanished (silent, lease expired, deregistered), after the view
            forgot it.
        default_ttl_s, lease_grace_s: as for :class:`LeasedMembers`.
    """

    def __init__(
        self,
        store: EtcdStore,
        leadership: Leadership,
        view: CapacityView,
        placed_blocks: Callable[[str], int],
        on_gone: Callable[[str], None] = lambda _id: None,
        default_ttl_s: int = 10,
        lease_grace_s: int = 0,
    ) -> None:
        def added(server_id: str, info: MemberInfo) -> None:
            view.add(server_id, info.capacity_blocks, placed_blocks(server_id))
            log.info("member %s at %s: %d rBlocks", server_id, info.address, info.capacity_blocks)

        def gone(server_id: str) -> None:
            view.remove(server_id)
            on_gone(server_id)

        super().__init__(
            store,
            leadership,
            MEMBERS_PREFIX,
            "server_id",
            lambda info: info.server_id,
            MemberInfo.from_json,
            added,
            gone,
            default_ttl_s,
            lease_grace_s,
            "attention server",
        )
