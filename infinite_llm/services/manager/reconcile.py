"""Orphan reconciliation: the ledger against what attention servers hold and what compute instances run.

A failure between two steps of a protocol leaves rBlocks nobody will free: a compute instance that dies (or
whose ``Release`` the manager never saw, during an etcd or manager outage) leaves its ledger entries and
their rBlocks; a manager that dies between reserve and commit, or between a server's commit and a failed
ledger write, leaves rBlocks on servers with no ledger entry. The leader reconciles every ``interval_s``
seconds, from the reports that heartbeats carry (attention servers: committed rBlocks and open reservations
per sequence; compute instances: the sequences they hold or are placing) and the ledger in etcd:

- **owner gone**: a ledger entry whose owner is not a live compute instance (its lease expired);
- **not reported**: a ledger entry whose live owner's report, received after the previous pass read the
  ledger, does not list it (the owner added it before asking for its placement and keeps it until it
  released it, so a live sequence is always listed);
- **unledgered**: rBlocks (or reservations) a server reported, before the ledger was read, for a sequence
  whose ledger entry does not name that server, or that has none (committed rBlocks always follow the
  ledger write that names their server, DESIGN.md §5): e.g. a leftover of a placement whose release could
  not reach the server, beside the rBlocks of the sequence placed again elsewhere.

A suspect is reclaimed only when two consecutive passes find it with the same evidence (the same ledger
revision; a newer report for the report-based kinds), which rules out the placements and releases in flight
that one snapshot can catch half-way. Reclaiming an entry is ``GlobalManager.release`` (servers first, then
the ledger key); an unledgered sequence is freed on its server. Entries with no owner ('' = not told) are
left to whoever placed them. Figures: orphans are reclaimed within two passes plus one heartbeat period of
the fault (or of the owner's lease expiry), i.e. within one lease period with the default interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from infinite_llm.core.errors import InfiniteLLMError, NotFound
from infinite_llm.services.manager.ledger import LedgerRecord
from infinite_llm.services.manager.manager import GlobalManager
from infinite_llm.services.manager.placement import BlockServers
from infinite_llm.services.periodic import PeriodicTask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerReport:
    """An attention server's holdings at one heartbeat: rBlocks per sequence, committed and reserved."""

    sequences: Mapping[str, int]
    reserved: Mapping[str, int] = field(default_factory=dict)

    def holds(self) -> set[str]:
        """Sequences with committed rBlocks or an open reservation here."""
        return {s for s, n in self.sequences.items() if n > 0} | {s for s, n in self.reserved.items() if n > 0}


@dataclass(frozen=True)
class Orphan:
    """Something to reclaim. ``kind``: "owner_gone" / "not_reported" (a ledger entry) or "unledgered" (a
    sequence's rBlocks on ``server_id``, which its ledger entry does not name)."""

    kind: str
    seq_id: str
    server_id: str = ""


class Reports:
    """The latest report of each attention server and compute instance, numbered in arrival order."""

    def __init__(self) -> None:
        self.counter = 0
        self.servers: dict[str, tuple[int, ServerReport]] = {}
        self.computes: dict[str, tuple[int, frozenset[str]]] = {}

    def server(self, server_id: str, report: ServerReport) -> None:
        self.counter += 1
        self.servers[server_id] = (self.counter, report)

    def compute(self, instance_id: str, seq_ids: Iterable[str]) -> None:
        self.counter += 1
        self.computes[instance_id] = (self.counter, frozenset(seq_ids))

    def forget(self, live_servers: set[str], live_computes: set[str]) -> None:
        """Drop the reports of members that left (a rejoining member starts from a fresh report)."""
        self.servers = {s: r for s, r in self.servers.items() if s in live_servers}
        self.computes = {c: r for c, r in self.computes.items() if c in live_computes}


class Reconciler:
    """Finds and reclaims orphans every ``interval_s`` seconds while ``manager`` leads.

    ``reclaimed`` counts what it freed, by kind (rBlocks for "unledgered", entries for the others).
    """

    def __init__(
        self, manager: GlobalManager, servers: BlockServers, interval_s: float = 2.0, settle_s: float = 0.0
    ) -> None:
        """``settle_s``: after this manager starts leading, give members that long (one lease period) to
        register again before an owner counts as gone: a manager restart outlasts their leases."""
        self.manager, self.servers, self.interval_s, self.settle_s = manager, servers, interval_s, settle_s
        self._leading_since: float | None = None
        self.reports = Reports()
        self.reclaimed: dict[str, int] = {}
        self._suspects: dict[Orphan, tuple[int, int]] = {}  # -> (ledger mod_revision, report counter)
        self._read_mark = 0  # report counter when the previous pass had read the ledger
        self._loop = PeriodicTask("reconciler", self.run_once, interval_s)

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def run_once(self) -> list[Orphan]:
        """One pass: find suspects, reclaim those the previous pass found with the same evidence.

        Returns what was reclaimed. Raises ``Unavailable`` (etcd) or ``NotLeader`` (then nothing changed).
        """
        if not self.manager.is_leader:
            self._suspects.clear()
            self._leading_since = None
            return []
        now = time.monotonic()
        if self._leading_since is None:
            self._leading_since = now
        settled = now - self._leading_since >= self.settle_s
        servers = {m.info.server_id for m in self.manager.members()}
        computes = {m.info.instance_id for m in self.manager.computes.members.members()}
        self.reports.forget(servers, computes)
        before_read = self.reports.counter
        records = await self.manager.ledger.read_records()
        found = self._find(records, computes, before_read)
        self._read_mark = self.reports.counter
        if not settled:
            found = {o: ev for o, ev in found.items() if o.kind != "owner_gone"}
        confirmed = [o for o, ev in found.items() if self._confirms(o, ev)]
        self._suspects = {o: ev for o, ev in found.items() if o not in confirmed}
        done = []
        for orphan in confirmed:
            if await self._reclaim(orphan):
                done.append(orphan)
        return done

    def _find(self, records: list[LedgerRecord], computes: set[str], before_read: int) -> dict[Orphan, tuple[int, int]]:
        found: dict[Orphan, tuple[int, int]] = {}
        for r in records:
            if not r.owner:
                continue
            if r.owner not in computes:
                found[Orphan("owner_gone", r.seq_id)] = (r.mod_revision, 0)
                continue
            counter, seq_ids = self.reports.computes.get(r.owner, (0, None))
            orphan = Orphan("not_reported", r.seq_id)
            if seq_ids is not None and counter > self._read_mark:
                if r.seq_id not in seq_ids:
                    found[orphan] = (r.mod_revision, counter)
            elif self._suspects.get(orphan, (-1,))[0] == r.mod_revision:
                found[orphan] = self._suspects[orphan]  # no newer report yet: still suspected
        named = {r.seq_id: {server_id for server_id, _ in r.entries} for r in records}
        for server_id, (counter, report) in self.reports.servers.items():
            if counter > before_read:  # arrived during the read: judged next pass
                found.update({o: ev for o, ev in self._suspects.items() if o.server_id == server_id})
                continue
            for seq_id in report.holds():
                if server_id not in named.get(seq_id, ()):
                    found[Orphan("unledgered", seq_id, server_id)] = (0, counter)
        return found

    def _confirms(self, orphan: Orphan, evidence: tuple[int, int]) -> bool:
        """Found in the previous pass too: same ledger revision, and (report kinds) a newer report."""
        before = self._suspects.get(orphan)
        if before is None or before[0] != evidence[0]:
            return False
        return orphan.kind == "owner_gone" or evidence[1] > before[1]

    async def _reclaim(self, orphan: Orphan) -> bool:
        try:
            if orphan.kind == "unledgered":
                n = await self.servers.free(orphan.server_id, orphan.seq_id)
            else:
                n = 1
                await self.manager.release(orphan.seq_id)
        except NotFound:
            return False  # released meanwhile by its owner
        except InfiniteLLMError as e:
            log.warning("reclaiming %s failed (next pass retries): %s", orphan, e)
            return False
        self.reclaimed[orphan.kind] = self.reclaimed.get(orphan.kind, 0) + n
        log.warning("reclaimed orphan %s of sequence %s%s", orphan.kind, orphan.seq_id[:64], _on(orphan.server_id))
        return True


def _on(server_id: str) -> str:
    return f" on {server_id}" if server_id else ""
