"""Cluster-wide prefix caching, the manager's half (issue 13): match a new sequence's prompt against the
cluster's index and attach the cached rBlocks where they live; index the full rBlocks compute instances
publish; drop what servers evicted and what died with a server.

Neighbours: :class:`~.prefix_index.PrefixIndex` (``hash -> server`` in etcd, fenced), the attention servers
(:class:`~.placement.BlockServers` ``attach`` / ``cache``: each server keeps its own ``hash -> block`` map and
is the authority on what it still holds), and the placement ledger (an attached rBlock counts in its reader's
ledger entry like a placed one, so ``Release``, the reconciler and an idempotent ``Place`` see every rBlock a
sequence holds, shared or not).

Ordering (DESIGN.md §5: committed rBlocks follow their ledger write): the ledger records the matched prefix
first, one fenced compare-and-swap; then the servers attach; a shorter attach (a hash evicted meanwhile)
corrects the ledger with a second swap. Eviction happens on the server, atomically with its own map, when a
reservation needs room (least recently used among rBlocks with no reader): nothing can attach to an evicted
rBlock, and the hashes it drops come back in the reserve reply; the placement's ledger write that follows
deletes them from the index in its own transaction (``GlobalManager._record``; past etcd's transaction size,
the rest in the transactions right after it, before the placement returns). A hash a server reports in an
attach reply (evicted by a reservation whose reply was lost, or since its last reply) leaves right after
that match. An index entry can therefore be stale for a moment; that costs a miss, never wrong KV.

Source: vLLM v1 ``kv_cache_manager.get_computed_blocks`` / ``cache_blocks`` (the same split of match and
publish), SGLang's radix cache (LRU eviction of unreferenced nodes), over the paper's pooled rBlocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from infinite_llm.core.errors import DeadlineExceeded, InfiniteLLMError, InvalidRequest, NotFound, Unavailable
from infinite_llm.core.prefix_cache import HASH_BYTES, BlockHash
from infinite_llm.services.manager.ledger import LedgerRecord
from infinite_llm.services.manager.prefix_index import MAX_TXN_OPS, PrefixIndex
from infinite_llm.services.manager.records import Grant, LedgerEntries, check_id
from infinite_llm.state.etcd_store import EtcdStore

if TYPE_CHECKING:
    from infinite_llm.services.manager.manager import GlobalManager

log = logging.getLogger(__name__)
MAX_MATCH_BLOCKS = 1 << 16  # hashes one MatchPrefix may carry (a 1M-token prompt at block size 16)


class PrefixCaching:
    """The manager's prefix cache over ``manager``'s ledger, members and block servers.

    Raises (``match`` / ``publish``): ``InvalidRequest`` for malformed input, ``PermissionDenied`` when the
    caller speaks for a compute instance it did not register, ``NotLeader`` on a follower, ``Unavailable`` when
    etcd fails.
    """

    def __init__(self, manager: GlobalManager, store: EtcdStore) -> None:
        self._m = manager
        self.index = PrefixIndex(store, manager.leadership)
        self._uncached: dict[str, set[BlockHash]] = {}  # server -> hashes it reported gone, not yet unindexed
        self._background: set[asyncio.Task] = set()
        self.queries = 0  # rBlocks asked for by MatchPrefix
        self.hits = 0  # rBlocks attached by MatchPrefix

    def note_uncached(self, server_id: str, hashes: Sequence[BlockHash]) -> None:
        """``server_id`` reports ``hashes`` left its cache (evicted or cleared); the index drops them next."""
        if hashes:
            self._uncached.setdefault(server_id, set()).update(hashes)

    def evicted(self, limit: int | None = MAX_TXN_OPS - 1) -> list[BlockHash]:
        """Up to ``limit`` hashes servers reported gone whose entry still names that server: the next ledger
        write drops them from the index in its own transaction (:meth:`~.ledger.Ledger.swap` ``also``; the
        limit leaves room for the ledger's own write in etcd's ``MAX_TXN_OPS``), then :meth:`unindexed`. A
        reservation that evicts rBlocks is followed by its placement's ledger write, so they leave the index in
        the transaction that records the placement they made room for (past the limit: at the next write,
        match or publish; ``None``: all of them)."""
        index = self.index
        gone = (h for server_id, hashes in self._uncached.items() for h in hashes if index.server_of(h) == server_id)
        return list(itertools.islice(gone, limit))

    def unindexed(self, hashes: Sequence[BlockHash]) -> None:
        """``hashes`` left etcd's index (a committed transaction carried :meth:`evicted`'s deletions)."""
        self.index.forget(hashes)
        gone = set(hashes)
        for server_id in list(self._uncached):
            self._uncached[server_id] -= gone
            if not self._uncached[server_id]:
                del self._uncached[server_id]

    async def flush_uncached(self) -> int:
        """Unindex what servers reported gone (entries still naming that server); returns how many."""
        gone, self._uncached = self.evicted(limit=None), {}
        return await self.index.remove(gone)

    async def flush_uncached_quietly(self) -> int:
        """:meth:`flush_uncached` when servers reported anything gone, after a write that already took
        effect: a failure (etcd down, leadership lost) is logged and leaves the rest to the next write, match
        or publish (a stale entry costs a miss, never wrong KV). Returns how many left the index."""
        if not self._uncached:
            return 0
        try:
            return await self.flush_uncached()
        except InfiniteLLMError as e:
            log.warning("could not unindex the rBlocks servers reported evicted (left for later): %s", e)
            return 0

    async def drop_server(self, server_id: str) -> int:
        """A server left the cluster: its KV died with it, so its entries leave the index."""
        self._uncached.pop(server_id, None)
        return await self.index.drop_server(server_id)

    def server_gone(self, server_id: str) -> None:
        """Membership callback (synchronous): a server's key vanished; the leader drops its entries in the
        background (until then they cost misses only: a lookup skips servers that are not live)."""
        if not self._m.is_leader:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._drop_quietly(server_id))
        except RuntimeError:  # no running loop: the entries stay until a new leader reloads, as misses
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drop_quietly(self, server_id: str) -> None:
        try:
            dropped = await self.drop_server(server_id)
        except InfiniteLLMError as e:  # NotLeader, etcd down
            log.warning("could not drop the cached prefixes of %s from the index: %s", server_id, e)
            return
        if dropped:
            log.info("dropped %d cached rBlocks of lost server %s from the prefix index", dropped, server_id)

    # ---- match ---------------------------------------------------------------------------------------
    async def match(
        self, seq_id: str, hashes: Sequence[BlockHash], owner: str = "", identity: str | None = None
    ) -> list[Grant]:
        """Attach the longest cached prefix of ``hashes`` to the new sequence ``seq_id`` (logical indices
        ``0..``) and record it in its ledger entry. Returns one :class:`Grant` per run of consecutive rBlocks
        on one server, in table order; ``[]`` on a miss. A ledger entry the sequence already has (an earlier
        call whose reply was lost) is freed on its servers first, so a retry is idempotent."""
        check_id("seq_id", seq_id)
        if owner:
            check_id("instance_id", owner)
        _check_hashes(hashes)
        self._m.leadership.fence()
        await self.flush_uncached()
        record = await self._m.ledger.read(seq_id)
        self._m._check_owner(record, owner, identity)
        live = {m.info.server_id for m in self._m.members()}
        if record.entries:  # a retried MatchPrefix (its reply was lost): undo the earlier attempt first
            await self._undo(seq_id, record.entries, live)
        runs = _runs(self.index.longest_prefix(hashes, live))
        self.queries += len(hashes)
        if not runs and not record.entries:
            return []
        planned = _per_server([(s, n) for s, _, n in runs])
        await self._write(record, planned, owner)
        grants = await self._attach(seq_id, hashes, runs)
        attached = _per_server([(g.server_id, g.n_blocks) for g in grants])
        if attached != planned:  # a hash was evicted meanwhile: the ledger counts what was attached
            await self._write(await self._m.ledger.read(seq_id), attached, owner)
        await self.flush_uncached_quietly()  # what the attach replies reported gone leaves the index now
        for server_id, n in attached:
            self._m._placed[server_id] = self._m._placed.get(server_id, 0) + n
        self.hits += sum(n for _, n in attached)
        return grants

    async def _undo(self, seq_id: str, entries: LedgerEntries, live: set[str]) -> None:
        """Free what an earlier attempt left of the new sequence ``seq_id`` on each live server of its ledger
        entry (a lost server's KV died with it). Raises ``Unavailable`` (nothing attached, the caller retries)
        when a live server cannot be reached, or one has not registered again since this manager took the
        lead (:meth:`.GlobalManager.check_settled`): attaching over leftovers would mix two attempts' blocks."""
        log.info("sequence %s holds rBlocks at its first MatchPrefix (a lost reply); freeing them", seq_id[:64])
        self._m.check_settled(seq_id, entries)
        for server_id, _ in entries:
            if server_id in live:
                await self._m.block_servers.free(server_id, seq_id)
        self._m._forget_placed(entries)

    async def _attach(self, seq_id: str, hashes: Sequence[BlockHash], runs: list[tuple[str, int, int]]) -> list[Grant]:
        """Attach each run on its server until one comes back short (evicted meanwhile) or fails."""
        grants: list[Grant] = []
        for server_id, start, n in runs:
            try:
                run = list(hashes[start : start + n])
                ids, uncached = await self._m.block_servers.attach(server_id, seq_id, start, run)
            except InvalidRequest as e:  # the new sequence holds rBlocks there already: leftovers, freed
                log.warning("attach on %s for %s refused (%s); freeing its leftovers there", server_id, seq_id[:64], e)
                await self._m.block_servers.free(server_id, seq_id)
                del grants[next((i for i, g in enumerate(grants) if g.server_id == server_id), len(grants)) :]
                break
            except (Unavailable, NotFound, DeadlineExceeded) as e:  # gone, or frozen: the prefix ends before it
                log.warning("attach of %d cached rBlocks on %s for %s failed: %s", n, server_id, seq_id[:64], e)
                break
            self.note_uncached(server_id, uncached)
            if ids:
                grants.append(Grant(server_id, len(ids), tuple(ids)))
            if len(ids) < n:  # the server no longer caches hashes[start + len(ids)]: the prefix ends there
                self.note_uncached(server_id, [hashes[start + len(ids)]])
                break
        return grants

    async def _write(self, record: LedgerRecord, entries: LedgerEntries, owner: str) -> None:
        """Set ``record``'s entries to ``entries`` (not merged: a new sequence holds only its prefix; empty
        deletes the key), by compare-and-swap, re-read and retried on conflict."""
        for _ in range(self._m.config.max_txn_attempts):
            if owner and not record.owner:
                record = replace(record, owner=owner)
            conflict = await self._m.ledger.swap(record, entries)
            if conflict is None:
                return
            record = conflict
        raise self._m.ledger.too_contended(record.seq_id)

    # ---- publish -------------------------------------------------------------------------------------
    async def publish(self, blocks: Sequence[tuple[str, int, BlockHash, str]], identity: str | None = None) -> int:
        """Index full rBlocks one step completed: ``(seq_id, logical index, hash, server_id)`` each. Hashes the
        index already holds on a live server are skipped (one copy per hash); the servers mark the rest cached,
        then the index records them in one fenced transaction. Returns how many were indexed. A server that
        cannot be reached, or refuses (the sequence no longer holds that rBlock there), is skipped."""
        for seq_id in dict.fromkeys(b[0] for b in blocks):
            check_id("seq_id", seq_id)
        _check_hashes([b[2] for b in blocks])
        self._m.leadership.fence()
        for seq_id in dict.fromkeys(b[0] for b in blocks):
            self._m._check_owner(await self._m.ledger.read(seq_id), "", identity)
        await self.flush_uncached()
        live = {m.info.server_id for m in self._m.members()}
        await self.index.remove([b[2] for b in blocks if self.index.server_of(b[2]) not in (None, *live)])
        fresh: dict[tuple[str, str], list[tuple[int, BlockHash]]] = {}  # (server, seq) -> (index, hash)
        seen: set[BlockHash] = set()
        for seq_id, i, h, server_id in blocks:
            if self.index.server_of(h) is None and server_id in live and h not in seen:
                seen.add(h)
                fresh.setdefault((server_id, seq_id), []).append((i, h))
        added: list[tuple[BlockHash, str]] = []
        for (server_id, seq_id), entries in fresh.items():
            try:
                cached = await self._m.block_servers.cache(
                    server_id, seq_id, [i for i, _ in entries], [h for _, h in entries]
                )
            except InfiniteLLMError as e:
                log.warning("cache of %d rBlocks of %s on %s failed: %s", len(entries), seq_id[:64], server_id, e)
                continue
            added.extend((h, server_id) for h in cached)
        return len(await self.index.add(added))

    def blocks_per_server(self) -> dict[str, int]:
        """Indexed (cached) rBlocks per server (``infinite-llm status``)."""
        return self.index.blocks_per_server()


def _per_server(entries: LedgerEntries) -> LedgerEntries:
    """Ledger entries: one per server, counts summed, first seen first (a prefix may leave and come back)."""
    out: dict[str, int] = {}
    for server_id, n in entries:
        out[server_id] = out.get(server_id, 0) + n
    return list(out.items())


def _runs(servers: list[str]) -> list[tuple[str, int, int]]:
    """``[(server_id, first index, n)]``: the runs of consecutive equal servers of a matched prefix."""
    runs, start = [], 0
    for server_id, group in itertools.groupby(servers):
        n = len(list(group))
        runs.append((server_id, start, n))
        start += n
    return runs


def _check_hashes(hashes: Sequence[BlockHash]) -> None:
    if len(hashes) > MAX_MATCH_BLOCKS:
        raise InvalidRequest(f"at most {MAX_MATCH_BLOCKS} block hashes per call, got {len(hashes)}")
    bad = [i for i, h in enumerate(hashes) if len(h) != HASH_BYTES]
    if bad:
        raise InvalidRequest(
            f"block hashes must be {HASH_BYTES} bytes; those at {bad[:8]} are not", param="block_hashes"
        )
