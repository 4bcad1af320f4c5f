"""The global manager (PAPER.md "Managers", gManager): membership, capacity view, placement ledger.

It composes :mod:`membership` (leased ``members/`` keys and a watch), :mod:`computes` (the compute
instances, leased the same way under ``computes/``, with their loads, homes and debts), :mod:`capacity`
(the in-memory view fed by heartbeats), :mod:`placement` (near first, then most free; reserve before use)
and :mod:`ledger` (``ledger/<seq_id>`` written by compare-and-swap), all fenced by :mod:`leadership`. etcd
is the source of truth: a new instance rebuilds everything from it (DESIGN.md §5-§6). The gRPC servicer is
a thin layer over :class:`GlobalManager`; the attention servers are reached through an injected
:class:`BlockServers`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import (
    CapacityExhausted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from infinite_llm.services.manager.admissions import CLAIM_TTL_S, AdmissionClaims
from infinite_llm.services.manager.capacity import CapacityView
from infinite_llm.services.manager.computes import (
    ComputeInfo,
    ComputeInstances,
    ComputeLoad,
    ComputeState,
    check_address,
    debts,
)
from infinite_llm.services.manager.drain import DrainGuard
from infinite_llm.services.manager.keyed_locks import KeyedLocks
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.ledger import Ledger, LedgerRecord
from infinite_llm.services.manager.membership import Membership, Registration
from infinite_llm.services.manager.migrations import Migrations
from infinite_llm.services.manager.placement import BlockServers, Held, cancel_held, reserve_placement
from infinite_llm.services.manager.prefix import PrefixCaching
from infinite_llm.services.manager.rebalance import Rebalancer
from infinite_llm.services.manager.records import (
    ClusterState,
    Grant,
    LedgerEntries,
    Member,
    MemberInfo,
    MemberState,
    blocks_per_server,
    check_id,
    merge_ledger,
)
from infinite_llm.services.manager.refusals import Refusals
from infinite_llm.state.etcd_store import EtcdStore

log = logging.getLogger(__name__)
MEMBER_LEASE_MARGIN_S = 5  # a member's lease outlives a failover by this much (seconds)


@dataclass(frozen=True)
class ManagerConfig:
    """Global manager settings. TTLs in seconds (etcd's minimum lease TTL is ~2 s)."""

    manager_id: str
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per rBlock of the cluster: members and callers must agree
    member_ttl_s: int = 10
    leader_ttl_s: int = 10
    max_txn_attempts: int = 16
    # After this manager starts leading, an attention server not registered (yet) counts as unknown, not lost,
    # for this long (seconds; the serving manager uses one member TTL): members' leases outlive a failover
    # (``member_lease_grace_s``) but lapse when etcd or the managers were gone longer, and such members
    # register again within a heartbeat of reaching this one, keeping their
    # rBlocks. Meanwhile a free that would skip such a server, and a placement that finds no room, are
    # refused with ``Unavailable`` (the caller retries) instead of dropping its rBlocks from the ledger or
    # reporting a full cluster. 0: a server not registered is lost at once.
    settle_s: float = 0.0

    @property
    def member_lease_grace_s(self) -> int:
        """How much longer than ``member_ttl_s`` a member's etcd lease lasts (seconds). While a manager leads
        it removes silent members itself after ``member_ttl_s``; the lease removes them when none leads, and
        this grace outlasts a failover (the leader's session lease, a campaign, a member's retry), so a crash
        of the leader costs no member its registration."""
        return self.leader_ttl_s + MEMBER_LEASE_MARGIN_S

    def __post_init__(self) -> None:
        check_id("manager_id", self.manager_id)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("member_ttl_s", "leader_ttl_s"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 s (etcd's minimum lease), got {getattr(self, name)}")
        if self.max_txn_attempts < 1:
            raise ValueError(f"max_txn_attempts must be >= 1, got {self.max_txn_attempts}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")


class GlobalManager:
    """Membership, capacity view and placement ledger of the cluster, kept in etcd.

    Every write raises ``NotLeader`` (an ``Unavailable``) unless this manager leads; etcd failures raise
    ``Unavailable``.
    """

    def __init__(self, store: EtcdStore, servers: BlockServers, config: ManagerConfig) -> None:
        self.config = config
        # Every manager can drain a server (one stopping on its own, or the autoscaler's): its BlockServers
        # are always seen through a DrainGuard.
        self.drains = servers if isinstance(servers, DrainGuard) else DrainGuard(servers)
        self._servers: BlockServers = self.drains
        self.view = CapacityView()
        self.leadership = Leadership(store, config.manager_id, config.leader_ttl_s)
        self.ledger = Ledger(store, self.leadership, config.max_txn_attempts)
        self._placed: dict[str, int] = {}  # rBlocks the ledger places per server
        ttl_s, grace_s = config.member_ttl_s, config.member_lease_grace_s
        self.membership = Membership(
            store,
            self.leadership,
            self.view,
            lambda s: self._placed.get(s, 0),
            lambda s: self.prefix.server_gone(s),
            ttl_s,
            grace_s,
        )
        self.computes = ComputeInstances(store, self.leadership, ttl_s, grace_s)
        self.migrations = Migrations(self.drains, self.ledger, self.view, self.address_of, config.max_txn_attempts)
        self.rebalancer = Rebalancer(self)
        self._placing = KeyedLocks()  # one Place of a sequence at a time (a retry waits for the first)
        self.prefix = PrefixCaching(self, store)  # the cluster's prefix cache (MatchPrefix / PublishPrefix)
        self.drains.on_uncached = self.prefix.note_uncached  # evicted cached rBlocks leave the index
        self.migrations.prefix_index = self.prefix.index  # moved shared rBlocks: the index follows them
        self.refusals = Refusals()  # registrations refused lately (another model, block size or identity)
        # refused admissions, served first come, first served (Place); compute heartbeats (every third of the
        # member TTL) renew them: they outlive two missed ones
        self.admissions = AdmissionClaims(ttl_s=max(CLAIM_TTL_S, float(config.member_ttl_s)))
        self._claims_term: float | None = None  # the leading term the claims belong to (leading_since)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self, acquire_timeout_s: float | None = None) -> None:
        """Rebuild members, ledger totals and the view from etcd, watch members, and campaign.

        Args:
            acquire_timeout_s: wait up to this many seconds to lead (raise ``NotLeader`` after; 0: campaign
                once); ``None``: campaign once and start as a follower if another manager leads.
        """
        await self._load_placed()
        await self.membership.start()
        await self.computes.start()
        if acquire_timeout_s is None:
            await self.leadership.campaign()
            await self.prefix.index.load()
        else:
            await self.acquire_leadership(acquire_timeout_s)

    async def acquire_leadership(self, timeout_s: float) -> None:
        """Become leader within ``timeout_s`` seconds (0: one campaign), then reload what the previous leader
        placed. Raises ``NotLeader`` when another manager still leads then."""
        await self.leadership.acquire(timeout_s)
        await self._load_placed()
        await self.prefix.index.load()
        for member in self.membership.members():
            self.view.add(
                member.info.server_id, member.info.capacity_blocks, self._placed.get(member.info.server_id, 0)
            )

    async def stop(self, resign: bool = True) -> None:
        """Stop watching; ``resign`` gives up leadership at once (else it lapses after ``leader_ttl_s``)."""
        await self.membership.stop()
        await self.computes.stop()
        await self.migrations.stop()
        await self.leadership.close(resign)

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    @property
    def settling(self) -> bool:
        """Whether this manager took the lead less than ``config.settle_s`` seconds ago (see ManagerConfig)."""
        since = self.leadership.leading_since
        return since is not None and time.monotonic() - since < self.config.settle_s

    def check_settled(self, seq_id: str, entries: LedgerEntries) -> None:
        """Before freeing ``seq_id`` on the servers of its ledger ``entries``, where a server not registered
        would be skipped as lost.

        Raises:
            Unavailable: this manager is :attr:`settling` and one of them has not registered again yet (it
                may hold the sequence's rBlocks still; dropping them from the ledger would leave them to
                collide with the sequence's next placement). Nothing changed; retry shortly.
        """
        if not self.settling:
            return
        live = {m.info.server_id for m in self.members()}
        unknown = sorted({server_id for server_id, _ in entries} - live)
        if unknown:
            raise Unavailable(
                f"cannot free {seq_id!r} yet: attention servers {unknown} have not registered again since this "
                f"manager took the lead; retry shortly"
            )

    async def _load_placed(self) -> None:
        self._placed = blocks_per_server(await self.ledger.read_all())

    # ---- membership ------------------------------------------------------------------------------
    async def register(
        self,
        server_id: str,
        address: str,
        capacity_blocks: int,
        block_size: int,
        kind: str = "attention",
        ttl_s: int | None = None,
        node_name: str = "",
        identity: str = "",
        kv_layout: str = "",
    ) -> Registration:
        """Register a server under a lease of ``ttl_s`` seconds (default ``member_ttl_s``); ``node_name``: the
        machine it runs on, which makes it a home of the compute instances registered with that node;
        ``identity``: the subject of its certificate; ``kv_layout``: the KV it keeps (``rpc.kv_layout.kv_layout_text``,
        '' = not told). While a registration of ``server_id`` lives, only the same identity at the same address
        may register it again (a restart, a lost reply).

        Raises:
            InvalidRequest: a bad id, address, node name, capacity (rBlocks) or block size (tokens).
            FailedPrecondition: the server's block size differs from the cluster's, or its KV layout from a
                live member's.
            PermissionDenied: ``server_id`` is registered live from another identity or address.
            NotLeader: this manager does not lead.
        """
        info = MemberInfo(server_id, address, capacity_blocks, block_size, kind, node_name, identity, kv_layout)
        check_address(address)
        with self._refusing("attention", server_id, address):
            self.check_block_size(block_size, f"attention server {server_id!r}")
            self.check_kv_layout(kv_layout, f"attention server {server_id!r} keeps", ("attention", server_id))
            live = next((m.info for m in self.membership.members() if m.info.server_id == server_id), None)
            if live is not None and (live.identity, live.address) != (identity, address):
                raise PermissionDenied(
                    f"attention server {server_id!r} is registered from another identity or address; it may "
                    "register again when that registration's lease ends",
                    param="server_id",
                )
        registration = await self.membership.register(info, ttl_s or self.config.member_ttl_s)
        self.refusals.forget("attention", server_id)
        if self.drains.announce(server_id, False):  # a server (re)started under this id is not stopping
            log.info("attention server %s registered again: no longer draining", server_id)
        return registration

    async def heartbeat(self, server_id: str, free_blocks: int, load: float = 0.0, draining: bool = False) -> int:
        """Keep the member alive and record its free rBlocks and load; returns its TTL in seconds.
        ``draining``: the server is stopping; placement skips it and the planner migrates its rBlocks away
        until a heartbeat without it (:class:`~.drain.DrainGuard`).

        Raises:
            NotFound: the member is unknown or expired (it must register again).
        """
        ttl = await self.membership.keep_alive(server_id)
        self.view.heartbeat(server_id, free_blocks, load)
        if self.drains.announce(server_id, draining):
            log.info("attention server %s %s", server_id, "is stopping: draining it" if draining else "is not draining")
        return ttl

    async def deregister(self, server_id: str) -> None:
        """Remove a member now (revokes its lease). Raises NotFound if it is not a live member."""
        await self.membership.deregister(server_id)

    @property
    def block_servers(self) -> BlockServers:
        return self._servers

    def address_of(self, server_id: str) -> str | None:
        """``host:port`` of a live member, or ``None``."""
        return next((m.info.address for m in self.members() if m.info.server_id == server_id), None)

    def members(self) -> list[Member]:
        """Live members by server id (the watch keeps this current)."""
        return self.membership.members()

    @contextmanager
    def _refusing(self, kind: str, member_id: str, address: str) -> Iterator[None]:
        """Records in ``refusals`` (for ``status``) a registration the body refuses: another block size, KV
        layout or identity (``FailedPrecondition``, ``PermissionDenied``), then lets the error through."""
        try:
            yield
        except (FailedPrecondition, PermissionDenied) as e:
            self.refusals.note(kind, member_id, address, e.message)
            log.warning("refused the registration of %s %s at %s: %s", kind, member_id, address, e.message)
            raise

    def check_kv_layout(self, kv_layout: str, who: str, member: tuple[str, str]) -> None:
        """Raises ``FailedPrecondition`` when a live member other than ``member`` (``("attention", server_id)``
        or ``("compute", instance_id)``) keeps or needs KV other than ``kv_layout`` ('' = not told: no check).
        The first members fix a cluster's model and dtype; a server or instance of another is refused before
        any rBlock is placed on it or for it (its every step would be refused)."""
        if not kv_layout:
            return
        live = [(("attention", m.info.server_id), m.info.kv_layout) for m in self.membership.members()]
        live += [(("compute", m.info.instance_id), m.info.kv_layout) for m in self.computes.members.members()]
        roles = {"attention": "attention server", "compute": "compute instance"}
        other = sorted((layout, f"{roles[kind]} {name}") for (kind, name), layout in live
                       if layout and layout != kv_layout and (kind, name) != member)  # fmt: skip
        if other:
            layout, names = other[0][0], ", ".join(n for lay, n in other if lay == other[0][0])
            raise FailedPrecondition(
                f"{who} KV as {kv_layout}; this cluster's live members ({names}) use {layout}: give every "
                "attention server and compute instance of a cluster the same model and dtype"
            )

    def check_block_size(self, block_size: int, who: str) -> None:
        """Raises ``FailedPrecondition`` unless ``block_size`` (tokens) is the cluster's."""
        if block_size != self.config.block_size:
            raise FailedPrecondition(
                f"{who} uses rBlocks of {block_size} tokens; this cluster's block_size is {self.config.block_size}"
            )

    # ---- compute instances -----------------------------------------------------------------------
    async def register_compute(self, info: ComputeInfo, ttl_s: int | None = None) -> Registration:
        """Register a compute instance under a lease of ``ttl_s`` seconds (default ``member_ttl_s``). While a
        registration of ``info.instance_id`` lives, only the same identity (``info.identity``, its
        certificate's subject) may register it again: at its address, or at another once the registered instance's
        heartbeats are late (a restarted instance on a new port; :meth:`.ComputeInstances.check_takeover`).

        Raises:
            PermissionDenied: ``info.instance_id`` is registered live by another identity, or at another
                address by an instance that still heartbeats (a second process under its id).
            FailedPrecondition: the KV its model and dtype need (``info.kv_layout``) differs from a live
                member's.
            NotLeader: this manager does not lead.
        """
        with self._refusing("compute", info.instance_id, info.address):
            self.computes.check_owner(info.instance_id, info.identity)
            self.computes.check_takeover(info)
            who = f"compute instance {info.instance_id!r} needs"
            self.check_kv_layout(info.kv_layout, who, ("compute", info.instance_id))
        registration = await self.computes.register(info, ttl_s or self.config.member_ttl_s)
        self.refusals.forget("compute", info.instance_id)
        return registration

    async def heartbeat_compute(self, instance_id: str, load: ComputeLoad) -> int:
        """Keep the instance alive and record its load; returns its TTL in seconds.

        Raises:
            InvalidRequest: a malformed id. NotFound: unknown or expired (it must register again).
        """
        return await self.computes.heartbeat(instance_id, load)

    async def deregister_compute(self, instance_id: str) -> None:
        """Remove a compute instance now (and the claims of its waiting requests). Raises NotFound if it is
        not registered."""
        await self.computes.deregister(instance_id)
        self.admission_claims().drop_owner(instance_id)

    async def compute_instances(self, include_debts: bool = False) -> list[ComputeState]:
        """Live compute instances by id, with homes and last load; debts only if asked (reads the ledger)."""
        owed = None
        if include_debts:
            owed = await self._debts(await self.ledger.read_records())
        return self.computes.states((m.info for m in self.members()), owed)

    async def _debts(self, records: list[LedgerRecord]) -> dict[str, int]:
        servers = [m.info for m in self.members()]
        return debts(records, {m.info.instance_id: m.info.homes(servers) for m in self.computes.members.members()})

    # ---- placement -------------------------------------------------------------------------------
    async def place(
        self,
        seq_id: str,
        n_blocks: int,
        near: str | None = None,
        first_index: int | None = None,
        owner: str = "",
        identity: str | None = None,
        admission: bool = False,
    ) -> list[Grant]:
        """Place ``n_blocks`` more rBlocks of ``seq_id``: near server and the owner's homes first, then the
        servers the planner lets the owner borrow from (:meth:`.Rebalancer.placement_targets`). ``near``
        (compute instances name the server of the sequence's last rBlock, to keep it on few servers) is
        ignored when the owner has homes and it is not one of them.

        Reserves on the servers, records the ledger in one fenced compare-and-swap (re-read and retried on
        conflict), then commits the reservations.

        ``first_index`` is the logical index of the first new rBlock in the sequence's block table: the
        servers record each rBlock's index at commit, in grant order, and plan steps from them (``None``:
        after the rBlocks the ledger counts). Place is idempotent per ``(seq_id, first_index)``: rBlocks the
        ledger counts at or past ``first_index`` are ones the caller never learnt of (a reply lost when the
        manager died; the caller retried), so they are freed first (:meth:`_truncate`). Places of one
        sequence run one at a time.
        ``owner``: the compute instance running the sequence ('' = not told); the ledger records it with the
        sequence's first placement, which is how debts are counted.
        ``identity``: the caller's certificate subject (``None``: the manager itself, unchecked); a sequence
        owned by a live compute instance grows only for the identity that registered that instance.
        ``admission``: the caller admits the waiting sequence with these rBlocks (its first beyond a matched
        prefix). Admissions are served first come, first served across compute instances: one is refused
        while it would take rBlocks that older refused admissions wait for (:mod:`.admissions`); growth is not.

        Returns:
            One :class:`Grant` per server used, in placement order (near server first).

        Raises:
            InvalidRequest: bad ``seq_id`` or ``n_blocks <= 0``.
            PermissionDenied: ``owner`` or the sequence's recorded owner is live under another identity.
            CapacityExhausted: the cluster cannot hold them, or (``admission``) older admissions wait for them;
                no reservation or ledger change remains. ``Unavailable`` instead while this manager is
                :attr:`settling` (retry shortly).
            NotLeader: this manager does not lead (nothing remains reserved).
            Unavailable: etcd failed (reservations cancelled), or a server died between reserve and commit
                (the ledger keeps the placement: ``release`` the sequence).
        """
        check_id("seq_id", seq_id)
        if n_blocks <= 0:
            raise InvalidRequest(f"n_blocks must be > 0, got {n_blocks}", param="n_blocks")
        if first_index is not None and first_index < 0:
            raise InvalidRequest(f"first_index must be >= 0, got {first_index}", param="first_block_index")
        if owner:
            check_id("instance_id", owner)
        if near:
            check_id("near_server_id", near)
        self.leadership.fence()  # fail before reserving anything
        async with self._placing.hold(seq_id):
            record = await self.ledger.read(seq_id)
            self._check_owner(record, owner, identity)  # before a claim names the owner
            if not admission:
                return await self._place(seq_id, n_blocks, near, first_index, owner, record)
            claims = self.admission_claims()
            placed = sum(n for _, n in record.entries)
            retry = first_index is not None and placed > first_index  # its first attempt committed; reply lost
            if not retry and not self.settling:  # settling: servers still registering, the view is partial
                capacity, free = self.view.totals()
                claims.check(seq_id, n_blocks, free, capacity, owner)
            try:
                grants = await self._place(seq_id, n_blocks, near, first_index, owner, record)
            except CapacityExhausted:
                claims.claim(seq_id, n_blocks, owner)
                raise
            claims.drop(seq_id)
            return grants

    def admission_claims(self) -> AdmissionClaims:
        """The claims of refused admissions (:mod:`.admissions`), emptied first if a new leading term began
        since they were made (they are the leader's soft state)."""
        if self._claims_term != self.leadership.leading_since:
            self.admissions.reset()
            self._claims_term = self.leadership.leading_since
        return self.admissions

    async def _place(
        self, seq_id: str, n_blocks: int, near: str | None, first_index: int | None, owner: str, record: LedgerRecord
    ) -> list[Grant]:
        """:meth:`place` once the caller read ``record`` (the sequence's ledger entry) and checked its owner."""
        placed = sum(n for _, n in record.entries)
        if first_index is None:
            first_index = placed
        elif placed > first_index:
            record = await self._truncate(record, first_index)
        homes, lenders = await self.rebalancer.placement_targets(owner, n_blocks) if owner else ((), None)
        try:
            held = await reserve_placement(self._servers, self.view, seq_id, n_blocks, near, homes, lenders)
        except CapacityExhausted as e:
            if self.settling:  # the servers holding the cluster's free rBlocks may not have registered yet
                raise Unavailable(f"{e} (servers are registering again since this manager took the lead)") from e
            raise
        try:
            await self._record(record, [(h.server_id, h.n_blocks) for h in held], owner)
        except BaseException:
            await cancel_held(self._servers, self.view, held)
            raise
        for h in held:
            self._placed[h.server_id] = self._placed.get(h.server_id, 0) + h.n_blocks
        return await self._commit(held, first_index)

    async def _truncate(self, record: LedgerRecord, first_index: int) -> LedgerRecord:
        """Make Place idempotent: the ledger counts rBlocks of the sequence at or past ``first_index``, which
        the caller does not know it has (its block table is ``first_index`` long): a Place whose reply was
        lost (the manager died after the commit; the caller retried), or a manager that died between the
        ledger write and the commit. Free them on their servers, set the ledger to what the servers still
        hold, and return the record as written; the caller then places the blocks again.

        A server that cannot be reached keeps its count (its rBlocks are reclaimed with it). Raises
        ``Unavailable`` (nothing changed) for a server not registered again since this manager took the lead
        (:meth:`check_settled`): it may hold rBlocks at the indices about to be placed again."""
        log.info("Place of %s at block %d again: dropping its rBlocks from there first", record.seq_id, first_index)
        self.check_settled(record.seq_id, record.entries)
        for _ in range(self.config.max_txn_attempts):
            held: LedgerEntries = []
            for server_id, n in record.entries:
                try:
                    held.append((server_id, await self._servers.truncate(server_id, record.seq_id, first_index)))
                except (Unavailable, NotFound) as e:
                    log.warning("truncate %s on %s failed, count kept: %s", record.seq_id, server_id, e)
                    held.append((server_id, n))
            entries = [(server_id, n) for server_id, n in held if n > 0]
            conflict = await self.ledger.swap(record, entries)
            if conflict is None:
                self._forget_placed(_dropped(record.entries, entries))
                return await self.ledger.read(record.seq_id)
            record = conflict
        raise self.ledger.too_contended(record.seq_id)

    async def _record(self, record: LedgerRecord, added: LedgerEntries, owner: str = "") -> None:
        """Add ``added`` to the sequence's ledger entry (fenced compare-and-swap, retried on conflicts). The
        cached rBlocks the reservations evicted leave the prefix index in the same transaction (those past
        etcd's transaction size in the transactions right after it)."""
        evicted = self.prefix.evicted()
        for _ in range(self.config.max_txn_attempts):
            if owner and not record.owner:
                record = replace(record, owner=owner)
            also = self.prefix.index.deletions(evicted)
            conflict = await self.ledger.swap(record, merge_ledger(record.entries, added), also)
            if conflict is None:
                self.prefix.unindexed(evicted)
                await self.prefix.flush_uncached_quietly()  # more than one transaction holds
                return
            log.info("ledger of %s changed concurrently; retrying", record.seq_id)
            record = conflict
        raise self.ledger.too_contended(record.seq_id)

    async def _commit(self, held: list[Held], first_index: int) -> list[Grant]:
        grants = []
        for h in held:
            indices = list(range(first_index, first_index + h.n_blocks))
            block_ids = await self._servers.commit(h.server_id, h.reservation.reservation_id, indices)
            grants.append(Grant(h.server_id, h.n_blocks, tuple(block_ids)))
            first_index += h.n_blocks
        return grants

    def _check_owner(self, record: LedgerRecord, owner: str, identity: str | None) -> None:
        """Raises ``PermissionDenied`` when ``identity`` speaks for a live compute instance it did not
        register: the one it names (``owner``) or the one the ledger records for the sequence."""
        if identity is None:
            return
        for instance_id in {owner, record.owner} - {""}:
            self.computes.check_owner(instance_id, identity)

    async def release(self, seq_id: str, identity: str | None = None) -> int:
        """Free every rBlock of ``seq_id`` on its servers and delete its ledger key; returns rBlocks freed.

        Servers are freed before the ledger key goes, so a crash in between leaves a ledger entry to retry,
        never a leaked block. An unreachable server is skipped (its blocks died with it). ``identity``: the
        caller's certificate subject, as for :meth:`place` (``None``: the manager itself).

        Raises:
            Unavailable: a server of the sequence has not registered again since this manager took the lead
                (:meth:`check_settled`; nothing changed), or etcd failed.
            NotFound: the ledger has no placement for ``seq_id``.
            PermissionDenied: the sequence's owner is live under another identity.
            NotLeader: this manager does not lead.
        """
        check_id("seq_id", seq_id)
        self.leadership.fence()
        record, freed = await self.ledger.read(seq_id), 0
        for _ in range(self.config.max_txn_attempts):
            if record.mod_revision == 0:
                raise NotFound(f"no placement for sequence {seq_id!r}")
            self._check_owner(record, "", identity)
            self.check_settled(seq_id, record.entries)
            freed += await self._free_on_servers(seq_id, record.entries)
            conflict = await self.ledger.swap(record, None)
            if conflict is None:
                self._forget_placed(record.entries)
                return freed
            record = conflict
        raise self.ledger.too_contended(seq_id)

    async def _free_on_servers(self, seq_id: str, entries: LedgerEntries) -> int:
        """Free ``seq_id`` on its servers, all at once; one that is down, does not know it, or does not answer
        in time (frozen) is skipped: its blocks died with it, or come back as orphans from its heartbeats."""

        async def free(server_id: str) -> int:
            try:
                return await self._servers.free(server_id, seq_id)
            except (Unavailable, NotFound, DeadlineExceeded) as e:
                log.warning("free %s on %s failed, skipped: %s", seq_id, server_id, e)
                return 0

        return sum(await asyncio.gather(*(free(server_id) for server_id, _ in entries)))

    def _forget_placed(self, entries: LedgerEntries) -> None:
        for server_id, n in entries:
            self._placed[server_id] = max(self._placed.get(server_id, 0) - n, 0)
            self.view.give_back(server_id, n)

    # ---- state -----------------------------------------------------------------------------------
    async def cluster_state(self) -> ClusterState:
        """Leader, live members with their (estimated) free rBlocks and load, the ledger from etcd with each
        sequence's owner, and the live compute instances with their debts."""
        records = await self.ledger.read_records()
        members = []
        for m in self.members():
            cap = self.view.get(m.info.server_id)
            if cap is not None:
                members.append(MemberState(m.info, cap.free_blocks, cap.load, cap.stale))
        computes = self.computes.states((m.info for m in self.members()), await self._debts(records))
        return ClusterState(
            await self.leadership.leader_id(),
            members,
            {r.seq_id: r.entries for r in records},
            {r.seq_id: r.owner for r in records if r.owner},
            computes,
        )


def _dropped(before: LedgerEntries, after: LedgerEntries) -> LedgerEntries:
    """rBlocks per server in ``before`` but not in ``after`` (counts only go down)."""
    left = dict(after)
    return [(server_id, n - left.get(server_id, 0)) for server_id, n in before if n > left.get(server_id, 0)]
