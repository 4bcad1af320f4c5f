"""Leader election and write fencing for global managers sharing one etcd.

A manager holds a session lease (kept alive by a task) and campaigns by creating the ``leader`` key under
it, only if absent. The revision of that write is its fencing token: every write of the manager carries a
compare ``mod_revision(leader) == token`` inside the same transaction, so a manager that lost the key (its
lease expired, another took over) cannot write even if it still believes it leads (DESIGN.md §5: never
trust a lock alone).
"""

from __future__ import annotations

import asyncio
import logging
import time

from infinite_llm.core.errors import NotFound, Unavailable
from infinite_llm.services.manager.records import LEADER_KEY
from infinite_llm.state.etcd_store import Compare, EtcdStore, KeyValue, Op, TxnResult

log = logging.getLogger(__name__)


class NotLeader(Unavailable):
    """This manager does not hold the ``leader`` key; ask the leader (maps to UNAVAILABLE: retry elsewhere)."""


class Leadership:
    """Campaign for, hold, check and give up the ``leader`` key.

    Args:
        store: the etcd store.
        manager_id: this manager's id (the ``leader`` key's value).
        ttl_s: session lease TTL in seconds; leadership survives a crash for at most this long.
    """

    def __init__(self, store: EtcdStore, manager_id: str, ttl_s: int) -> None:
        self._store = store
        self.manager_id = manager_id
        self.ttl_s = ttl_s
        self.lease_id: int | None = None
        self.token: int | None = None  # mod_revision of our leader key while we lead
        self.leading_since: float | None = None  # time.monotonic() when this term began (None: not leading)
        self._keep_alive: asyncio.Task | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this manager believes it leads (etcd has the last word: see :meth:`fence`)."""
        return self.token is not None

    async def campaign(self) -> bool:
        """Try once to become leader; whether this manager leads now. Never blocks on another leader."""
        if self.lease_id is None:
            await self._open_session()
        try:
            result = await self._try_create()
        except NotFound:  # our session lease expired before the keep-alive task noticed
            await self.close(resign=False)
            await self._open_session()
            result = await self._try_create()
        before = self.token
        if result.succeeded:
            self.token = result.revision
        else:
            holder = result.gets[0]
            self.token = holder.mod_revision if holder and holder.lease == self.lease_id else None
        if self.token is None:
            self.leading_since = None
        elif self.token != before:
            self.leading_since = time.monotonic()
            log.info("manager %s leads at revision %d", self.manager_id, self.token)
        return self.is_leader

    async def _try_create(self) -> TxnResult:
        return await self._store.txn(
            [Compare.absent(LEADER_KEY)],
            [Op.put(LEADER_KEY, self.manager_id.encode(), self.lease_id)],
            [Op.get(LEADER_KEY)],
        )

    async def acquire(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Campaign every ``poll_s`` seconds until leading.

        Raises:
            NotLeader: another manager still leads after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while not await self.campaign():
            if time.monotonic() >= deadline:
                raise NotLeader(f"manager {self.manager_id} did not become leader within {timeout_s} s")
            await asyncio.sleep(poll_s)

    def fence(self) -> Compare:
        """The compare every write of this manager must carry.

        Raises:
            NotLeader: this manager does not lead.
        """
        if self.token is None:
            raise NotLeader(f"manager {self.manager_id} is not the leader")
        return Compare.mod_revision(LEADER_KEY, self.token)

    def check(self, holder: KeyValue | None) -> None:
        """After a failed fenced transaction: raise if ``holder`` (the ``leader`` key read then) is not ours.

        Raises:
            NotLeader: the key is gone or belongs to another term; this manager stops believing it leads.
        """
        if holder is None or holder.mod_revision != self.token:
            self.token = self.leading_since = None
            who = "nobody" if holder is None else holder.value.decode(errors="replace")
            raise NotLeader(f"manager {self.manager_id} lost leadership (leader key held by {who})")

    async def leader_id(self) -> str | None:
        """The id of the current leader according to etcd, or ``None``."""
        holder = await self._store.get(LEADER_KEY)
        return None if holder is None else holder.value.decode()

    async def close(self, resign: bool = True) -> None:
        """Stop keeping the session alive; with ``resign`` revoke it now (the leader key goes at once)."""
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            self._keep_alive = None
        if resign and self.lease_id is not None:
            try:
                await self._store.revoke_lease(self.lease_id)
            except (Unavailable, NotFound) as e:  # NotFound: expired already
                log.warning("revoking session lease of %s failed: %s", self.manager_id, e)
        self.lease_id, self.token, self.leading_since = None, None, None

    async def _open_session(self) -> None:
        self.lease_id = await self._store.grant_lease(self.ttl_s)
        self._keep_alive = self._store.keep_alive(self.lease_id, self.ttl_s / 3, self._session_lost)

    def _session_lost(self) -> None:
        log.warning("manager %s session lease expired; leadership lost", self.manager_id)
        self.lease_id, self.token, self.leading_since, self._keep_alive = None, None, None, None
