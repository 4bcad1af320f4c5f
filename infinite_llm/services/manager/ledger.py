"""The placement ledger in etcd: ``ledger/<seq_id>`` -> ``[[server_id, n_blocks], ...]`` and the compute
instance that owns the sequence, when it said (see :mod:`.records`).

Every change is one etcd transaction guarded by two compares: the key's ``mod_revision`` as read (version
0 when creating: compare-and-swap, DESIGN.md §5) and the manager's leader fence. A compare that fails
because someone else wrote the key in between is a conflict: the caller re-reads and retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infinite_llm.core.errors import Unavailable
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.records import (
    LEADER_KEY,
    LEDGER_PREFIX,
    LedgerEntries,
    decode_ledger,
    encode_ledger,
)
from infinite_llm.state.etcd_store import Compare, EtcdStore, Op


@dataclass(frozen=True)
class LedgerRecord:
    """One sequence's ledger as read; ``mod_revision`` 0 means the key is absent (``entries`` empty).
    ``owner``: the compute instance that placed it ('' = not told); a swap keeps it."""

    seq_id: str
    entries: LedgerEntries
    mod_revision: int
    owner: str = ""


class Ledger:
    """Read and compare-and-swap the placement ledger. ``conflicts`` counts retried CAS failures."""

    def __init__(self, store: EtcdStore, leadership: Leadership, max_attempts: int = 16) -> None:
        self._store = store
        self._leadership = leadership
        self.max_attempts = max_attempts
        self.conflicts = 0

    async def read(self, seq_id: str) -> LedgerRecord:
        kv = await self._store.get(LEDGER_PREFIX + seq_id)
        if kv is None:
            return LedgerRecord(seq_id, [], 0)
        return LedgerRecord(seq_id, *_decoded(kv.value, kv.mod_revision))

    async def read_records(self) -> list[LedgerRecord]:
        """Every sequence's record (entries and owner), by seq_id."""
        got = await self._store.get_prefix(LEDGER_PREFIX)
        return sorted(
            (LedgerRecord(kv.key[len(LEDGER_PREFIX) :], *_decoded(kv.value, kv.mod_revision)) for kv in got.items),
            key=lambda r: r.seq_id,
        )

    async def read_all(self) -> dict[str, LedgerEntries]:
        """Every sequence's entries, by seq_id."""
        return {r.seq_id: r.entries for r in await self.read_records()}

    async def swap(
        self, record: LedgerRecord, entries: LedgerEntries | None, also: Sequence[Op] = ()
    ) -> LedgerRecord | None:
        """Replace ``record`` by ``entries`` (``None`` or empty: delete the key) if nobody wrote it since;
        ``also``: more writes of the same transaction (the prefix index's deletions of evicted rBlocks).

        Returns:
            ``None`` on success, else the record as it is now (re-read) for the caller's retry.

        Raises:
            NotLeader: the leader fence failed (nothing was written).
        """
        key = LEDGER_PREFIX + record.seq_id
        guard = Compare.absent(key) if record.mod_revision == 0 else Compare.mod_revision(key, record.mod_revision)
        op = Op.put(key, encode_ledger(entries, record.owner)) if entries else Op.delete(key)
        result = await self._store.txn(
            [self._leadership.fence(), guard], [op, *also], [Op.get(LEADER_KEY), Op.get(key)]
        )
        if result.succeeded:
            return None
        self._leadership.check(result.gets[0])
        self.conflicts += 1
        now = result.gets[1]
        if now is None:
            return LedgerRecord(record.seq_id, [], 0)
        return LedgerRecord(record.seq_id, *_decoded(now.value, now.mod_revision))

    def too_contended(self, seq_id: str) -> Unavailable:
        return Unavailable(f"ledger of {seq_id!r} changed {self.max_attempts} times in a row; try again")


def _decoded(value: bytes, mod_revision: int) -> tuple[LedgerEntries, int, str]:
    entries, owner = decode_ledger(value)
    return entries, mod_revision, owner
