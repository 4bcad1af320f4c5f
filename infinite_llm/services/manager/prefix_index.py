"""The cluster's prefix-cache index in etcd: ``prefix/<hex block hash>`` -> the attention server holding it.

One index for the whole cluster (issue 13): any compute instance publishes the full rBlocks it computed and
any other reuses them where they live. Only the server is recorded: each server keeps its own
``hash -> block`` map (``RManager.cached_block``) and refuses an attach whose hash it evicted since, so a
stale entry costs a miss, never wrong KV. Writes are single etcd transactions carrying the leader fence,
like the placement ledger (DESIGN.md §5); the leader keeps an in-memory mirror, reloaded from etcd when it
starts leading, so a lookup reads no etcd.

Used by :mod:`.prefix` (the manager's ``MatchPrefix`` / ``PublishPrefix``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from infinite_llm.core.prefix_cache import BlockHash
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.records import LEADER_KEY
from infinite_llm.state.etcd_store import EtcdStore, Op

PREFIX_INDEX_PREFIX = "prefix/"
# etcd refuses a transaction of more writes than its --max-txn-ops (default 128: "too many operations in txn
# request"); the index writes in transactions of at most this many.
MAX_TXN_OPS = 128


def index_key(block_hash: BlockHash) -> str:
    return PREFIX_INDEX_PREFIX + block_hash.hex()


class PrefixIndex:
    """``hash -> server_id`` of cached full rBlocks, in etcd (fenced writes) with an in-memory mirror.

    Raises (writes): ``NotLeader`` when the leader fence fails (nothing is written); etcd errors as
    ``Unavailable``.
    """

    def __init__(self, store: EtcdStore, leadership: Leadership) -> None:
        self._store = store
        self._leadership = leadership
        self._servers: dict[BlockHash, str] = {}

    async def load(self) -> int:
        """Rebuild the mirror from etcd (a new leader); returns the entries read."""
        got = await self._store.get_prefix(PREFIX_INDEX_PREFIX)
        self._servers = {bytes.fromhex(kv.key[len(PREFIX_INDEX_PREFIX) :]): kv.value.decode() for kv in got.items}
        return len(self._servers)

    def longest_prefix(self, hashes: Sequence[BlockHash], live: Collection[str]) -> list[str]:
        """The server of each of the first hashes that are indexed on a live server, up to the first miss."""
        servers = []
        for h in hashes:
            server = self._servers.get(h)
            if server is None or server not in live:
                break
            servers.append(server)
        return servers

    def server_of(self, block_hash: BlockHash) -> str | None:
        """The server indexed for ``block_hash``, or ``None``."""
        return self._servers.get(block_hash)

    def blocks_per_server(self) -> dict[str, int]:
        """Cached rBlocks indexed per server (``infinite-llm status``)."""
        out: dict[str, int] = {}
        for server in self._servers.values():
            out[server] = out.get(server, 0) + 1
        return out

    async def add(self, entries: Sequence[tuple[BlockHash, str]]) -> list[BlockHash]:
        """Index ``(hash, server_id)`` pairs whose hash is not indexed yet, in one fenced transaction;
        returns the hashes added (one copy per hash: a hash indexed meanwhile is skipped)."""
        new = {h: s for h, s in entries if h not in self._servers}
        items = list(new.items())
        for start in range(0, len(items), MAX_TXN_OPS):  # a step may complete more rBlocks than one txn holds
            chunk = items[start : start + MAX_TXN_OPS]
            await self._fenced([Op.put(index_key(h), s.encode()) for h, s in chunk])
            self._servers.update(chunk)
        return list(new)

    async def repoint(self, hashes: Sequence[BlockHash], src: str, dst: str) -> list[BlockHash]:
        """A migration moved the cached rBlocks of ``hashes`` from ``src`` to ``dst``: entries naming ``src``
        (or none: evicted meanwhile) name ``dst`` now, in fenced transactions; an entry naming another
        server stays. Returns the hashes written."""
        moved = [h for h in dict.fromkeys(hashes) if self._servers.get(h) in (None, src)]
        for start in range(0, len(moved), MAX_TXN_OPS):
            chunk = moved[start : start + MAX_TXN_OPS]
            await self._fenced([Op.put(index_key(h), dst.encode()) for h in chunk])
            self._servers.update((h, dst) for h in chunk)
        return moved

    async def remove(self, hashes: Sequence[BlockHash]) -> int:
        """Drop ``hashes`` (evicted, or found stale on their server) in fenced transactions of at most
        ``MAX_TXN_OPS`` deletions."""
        gone = [h for h in dict.fromkeys(hashes) if h in self._servers]
        for start in range(0, len(gone), MAX_TXN_OPS):
            chunk = gone[start : start + MAX_TXN_OPS]
            await self._fenced([Op.delete(index_key(h)) for h in chunk])
            self.forget(chunk)
        return len(gone)

    def deletions(self, hashes: Sequence[BlockHash]) -> list[Op]:
        """The etcd writes that drop ``hashes`` (for another fenced transaction to carry, which must stay within
        ``MAX_TXN_OPS`` writes); then :meth:`forget`."""
        return [Op.delete(index_key(h)) for h in hashes]

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """The mirror's half of :meth:`deletions`, once their transaction committed."""
        for h in hashes:
            self._servers.pop(h, None)

    async def drop_server(self, server_id: str) -> int:
        """Drop every entry of a lost server (its KV died with it: those prefixes are recomputed)."""
        return await self.remove([h for h, s in self._servers.items() if s == server_id])

    async def _fenced(self, ops: list[Op]) -> None:
        result = await self._store.txn([self._leadership.fence()], ops, [Op.get(LEADER_KEY)])
        if not result.succeeded:
            self._leadership.check(result.gets[0])  # raises NotLeader
