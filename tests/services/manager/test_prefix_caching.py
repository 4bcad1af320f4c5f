"""The manager's prefix cache against real etcd and real rManagers: a published prefix is attached to a new
sequence where it lives and counted in its ledger; a retried match is idempotent; an evicted hash costs a
miss and leaves the index; a lost server's entries go; only the owner's identity may match or publish."""

from __future__ import annotations

import asyncio

import pytest

from infinite_llm.core.errors import DeadlineExceeded, InvalidRequest, PermissionDenied, Unavailable
from infinite_llm.core.prefix_cache import block_hashes
from infinite_llm.services.manager import Grant
from infinite_llm.services.manager.computes import ComputeInfo
from infinite_llm.services.manager.local import LocalServers
from infinite_llm.services.manager.prefix_index import MAX_TXN_OPS, PREFIX_INDEX_PREFIX

from .helpers import make_servers, running_manager, wait_for

H = block_hashes(list(range(16)), 4, "m")  # 4 chained block hashes


async def _write_and_publish(m, seq_id: str = "w", n: int = 3) -> list[Grant]:
    """``seq_id`` gets ``n`` rBlocks and publishes them under ``H[:n]``."""
    grants = await m.place(seq_id, n)
    where = [g.server_id for g in grants for _ in range(g.n_blocks)]
    assert await m.prefix.publish([(seq_id, i, H[i], where[i]) for i in range(n)]) == n
    return grants


def test_a_published_prefix_is_attached_where_it_lives_and_counted_in_the_readers_ledger(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 6, "b": 4})
        a = servers.rmanagers["a"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            assert await _write_and_publish(m) == [Grant("a", 3, (0, 1, 2))]
            assert await m.prefix.publish([("w", 0, H[0], "a")]) == 0  # indexed already: one copy per hash
            assert m.prefix.blocks_per_server() == {"a": 3}
            assert await m.prefix.match("r", H) == [Grant("a", 3, (0, 1, 2))]  # H[3] is not cached: 3 hit
            assert [a.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 2]
            assert await m.place("r", 1, first_index=3) == [Grant("b", 1, (0,))]  # the private tail: most free
            assert (await m.cluster_state()).ledger == {"w": [("a", 3)], "r": [("a", 3), ("b", 1)]}
            assert (m.prefix.queries, m.prefix.hits) == (4, 3)

            assert await m.release("w") == 3  # the writer leaves: the reader keeps reading
            assert [a.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1] and a.pool.num_free == 3
            assert servers.rmanagers["b"].owned_blocks("r") == [0]
            assert await m.release("r") == 4
            assert (a.pool.num_free, a.pool.num_cached_free, (await m.cluster_state()).ledger) == (6, 3, {})

    asyncio.run(scenario())


def test_a_retried_match_frees_the_earlier_attempt_first(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 6})
        a = servers.rmanagers["a"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _write_and_publish(m)
            assert await m.prefix.match("r", H[:2]) == [Grant("a", 2, (0, 1))]
            assert await m.prefix.match("r", H[:2]) == [Grant("a", 2, (0, 1))]  # its reply was lost: again
            assert [a.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
            assert (await m.cluster_state()).ledger["r"] == [("a", 2)]
            await m.release("r")
            await m.release("w")
            assert a.pool.num_free == 6

    asyncio.run(scenario())


def test_an_evicted_block_is_a_miss_and_leaves_the_index(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        a = servers.rmanagers["a"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _write_and_publish(m)
            await m.release("w")  # parked: 0, 1, 2 (least recently used first)
            a.on_uncache = lambda hashes: None  # a server whose report of evictions has not come yet
            a.reserve("x", 2)  # takes the free block 3, then evicts block 0 (H[0]) behind the manager's back
            assert await m.prefix.match("r", H) == []
            assert (await m.cluster_state()).ledger == {}  # the planned entry was taken back
            assert m.prefix.index.server_of(H[0]) is None  # the stale entry left the index
            assert (m.prefix.index.server_of(H[1]), a.pool.num_cached_free) == ("a", 2)
            keys = {kv.key for kv in (await m.prefix.index._store.get_prefix(PREFIX_INDEX_PREFIX)).items}
            assert keys == {PREFIX_INDEX_PREFIX + H[1].hex(), PREFIX_INDEX_PREFIX + H[2].hex()}

    asyncio.run(scenario())


def test_a_frozen_servers_cached_prefix_is_a_miss_not_an_error(etcd_server, etcd_prefix):
    """An attach that times out (the server holding the prefix is frozen: SIGSTOP) ends the match there,
    as a server that is gone does: the request computes that prefix itself instead of failing its MatchPrefix
    (a walkthrough saw the frozen server's 10 s attach delay a recompute by as much)."""

    async def scenario():
        servers = make_servers({"a": 6, "b": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _write_and_publish(m)  # H[:3] cached on a
            attach = servers.attach

            async def frozen(server_id, *args):  # noqa: ANN001, ANN002, ANN202
                if server_id == "a":
                    raise DeadlineExceeded("Deadline Exceeded")
                return await attach(server_id, *args)

            servers.attach = frozen
            assert await m.prefix.match("r", H) == []
            assert "r" not in (await m.cluster_state()).ledger  # the planned entry was taken back
            assert await m.place("r", 2) == [Grant("b", 2, (0, 1))]  # placed as any new sequence (most free)

    asyncio.run(scenario())


def test_rblocks_a_placement_evicts_leave_the_index_in_the_transaction_that_records_it(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _write_and_publish(m)
            await m.release("w")  # parked: 0, 1, 2 (least recently used first); block 3 is plain free
            store, events = m.prefix.index._store, []
            watch = await store.watch_prefix("", events.append)
            try:
                # Room for 2: the free block 3, then the least recently used cached one, block 0 (H[0]).
                assert await m.place("x", 2) == [Grant("a", 2, (3, 0))]
                await wait_for(lambda: any(e.kv.key == "ledger/x" for e in events), timeout_s=5)
            finally:
                await watch.cancel()
            # No match or publish ran since: the placement's own ledger write dropped H[0], in one revision.
            assert m.prefix.index.server_of(H[0]) is None and m.prefix.evicted() == []
            keys = {kv.key for kv in (await store.get_prefix(PREFIX_INDEX_PREFIX)).items}
            assert keys == {PREFIX_INDEX_PREFIX + H[1].hex(), PREFIX_INDEX_PREFIX + H[2].hex()}
            changes = {(e.kind, e.kv.key): e.kv.mod_revision for e in events}
            (ledger_revision,) = [r for (kind, key), r in changes.items() if key == "ledger/x"]
            assert changes[("delete", PREFIX_INDEX_PREFIX + H[0].hex())] == ledger_revision
            assert await m.prefix.match("r", H) == []  # the chain starts at H[0]: a miss
            assert (m.prefix.index.server_of(H[1]), servers.rmanagers["a"].pool.num_cached_free) == ("a", 2)

    asyncio.run(scenario())


class RepliesReportEvictions(LocalServers):
    """In-process servers that, like attention servers, report the hashes they evicted in their next attach
    reply instead of at once."""

    def __init__(self, rmanagers) -> None:  # noqa: ANN001
        super().__init__(rmanagers)
        self.pending: dict[str, list[bytes]] = {}

    def _uncached(self, server_id: str, hashes: list[bytes]) -> None:
        self.pending.setdefault(server_id, []).extend(hashes)

    async def attach(self, server_id, seq_id, first_index, hashes):  # noqa: ANN001, ANN201
        ids, _ = await super().attach(server_id, seq_id, first_index, hashes)
        return ids, self.pending.pop(server_id, [])


def test_an_eviction_an_attach_reply_reports_leaves_the_index_with_that_match(etcd_server, etcd_prefix):
    """A full hit whose attach reply reports another cached rBlock evicted (by a reservation the manager never
    heard of) unindexes it before the match returns, not at the next match or publish."""
    other = block_hashes(list(range(100, 104)), 4, "m")[0]

    async def scenario():
        servers = RepliesReportEvictions(make_servers({"a": 5}).rmanagers)
        a = servers.rmanagers["a"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _write_and_publish(m)  # "w" reads H[0..2] in blocks 0, 1, 2
            assert await m.place("v", 1) == [Grant("a", 1, (3,))]
            assert await m.prefix.publish([("v", 0, other, "a")]) == 1
            await m.release("v")  # block 3 parked: the only rBlock with no reader
            a.reserve("x", 2)  # behind the manager's back: takes the free block 4, then evicts block 3
            assert m.prefix.index.server_of(other) == "a"  # not reported yet
            assert await m.prefix.match("r", H[:3]) == [Grant("a", 3, (0, 1, 2))]  # its reply reports it
            assert m.prefix.index.server_of(other) is None and m.prefix.evicted() == []
            keys = {kv.key for kv in (await m.prefix.index._store.get_prefix(PREFIX_INDEX_PREFIX)).items}
            assert keys == {PREFIX_INDEX_PREFIX + h.hex() for h in H[:3]}

    asyncio.run(scenario())


def test_more_rblocks_than_one_etcd_transaction_holds_are_indexed_and_evicted(etcd_server, etcd_prefix):
    """etcd refuses a transaction of more than 128 writes: a step that completes 300 rBlocks, and a placement
    that evicts them all, still index and unindex every one (in transactions of at most MAX_TXN_OPS), all
    before the placement returns."""

    async def scenario():
        n = 300
        hashes = block_hashes(list(range(n * 4)), 4, "m")
        servers = make_servers({"a": n})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.place("w", n)
            assert await m.prefix.publish([("w", i, hashes[i], "a") for i in range(n)]) == n
            store = m.prefix.index._store
            assert len((await store.get_prefix(PREFIX_INDEX_PREFIX)).items) == n
            await m.release("w")  # all parked
            store, events = m.prefix.index._store, []
            watch = await store.watch_prefix("", events.append)
            try:
                # Evicts all 300: the ledger write takes 127 of them along, the rest follow before Place returns.
                assert len(await m.place("x", n)) == 1
                assert (await store.get_prefix(PREFIX_INDEX_PREFIX)).items == [] and m.prefix.blocks_per_server() == {}
                await wait_for(lambda: sum(e.kind == "delete" for e in events) == n, timeout_s=5)
            finally:
                await watch.cancel()
            revisions = [e.kv.mod_revision for e in events if e.kind == "delete"]
            (ledger_revision,) = [e.kv.mod_revision for e in events if e.kv.key == "ledger/x"]
            assert revisions.count(ledger_revision) == MAX_TXN_OPS - 1  # in the placement's own transaction
            assert max(revisions.count(r) for r in set(revisions)) <= MAX_TXN_OPS
            assert await m.prefix.flush_uncached() == 0
            assert await m.release("x") == n

    asyncio.run(scenario())


def test_a_lost_servers_entries_leave_the_index_and_are_never_matched(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.place("w", 2, near="a")
            await m.place("v", 2, near="b")
            await m.prefix.publish([("w", 0, H[0], "a"), ("v", 0, H[1], "b"), ("w", 1, H[2], "a")])
            await m.deregister("b")
            assert await m.prefix.match("r", H) == [Grant("a", 1, (0,))]  # b is gone: the chain stops there
            await wait_for(lambda: m.prefix.blocks_per_server() == {"a": 2}, timeout_s=5)
            assert await m.prefix.index.load() == 2  # in etcd too

    asyncio.run(scenario())


def test_only_the_owners_identity_may_match_or_publish_and_bad_hashes_are_refused(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 6})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",), identity="compute-c0"))
            await m.place("w", 2, owner="c0", identity="compute-c0")
            with pytest.raises(PermissionDenied):
                await m.prefix.publish([("w", 0, H[0], "a")], identity="compute-other")
            assert await m.prefix.publish([("w", 0, H[0], "a")], identity="compute-c0") == 1
            with pytest.raises(PermissionDenied):
                await m.prefix.match("r", H, owner="c0", identity="compute-other")
            with pytest.raises(InvalidRequest):
                await m.prefix.match("r", [b"short"])
            with pytest.raises(InvalidRequest):
                await m.prefix.match("bad id", H)
            assert servers.rmanagers["a"].pool.ref_count(0) == 1  # nothing was attached
            assert (await m.cluster_state()).ledger == {"w": [("a", 2)]}

    asyncio.run(scenario())


def test_leftovers_of_a_lost_attempt_are_freed_never_attached_over(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 6, "b": 4})
        a = servers.rmanagers["a"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _write_and_publish(m)  # w's 3 blocks on a, cached
            a.attach("r", [0], [H[0]])  # "r" holds block 0 on a with no ledger entry (an attempt that was lost)
            assert await m.prefix.match("r", H) == []  # refused there: the leftovers are freed, a miss
            assert (a.owned_blocks("r"), a.pool.ref_count(0), (await m.cluster_state()).ledger) == (
                [],
                1,
                {"w": [("a", 3)]},
            )
            assert await m.prefix.match("r", H) == [Grant("a", 3, (0, 1, 2))]  # and the next try hits
            b = servers.rmanagers.pop("b")  # a live member that cannot be reached now
            await m.ledger.swap(await m.ledger.read("r"), [("a", 3), ("b", 1)])  # r also held a block on b
            with pytest.raises(Unavailable):
                await m.prefix.match("r", H)  # a retry cannot free b's leftovers: nothing is attached again
            assert [a.pool.ref_count(x) for x in (0, 1, 2)] == [1, 1, 1]  # a's part was freed first
            servers.rmanagers["b"] = b

    asyncio.run(scenario())


def test_a_migrated_shared_block_takes_all_its_readers_with_it(etcd_server, etcd_prefix):
    """Issue 13: "r" migrates the rBlocks it shares with "w" (3) and "x" (2) from a to c. Settling r's move
    points the index at c and gives w and x re-attach orders (ledger first, then a reservation on c holding a
    reference to each copy); w's instance commits and flips all three; x's order gets no result and expires:
    its reservation is cancelled and its ledger goes back to a. Nothing leaks."""
    import time

    from infinite_llm.services.manager.migrations import MigrationResult
    from infinite_llm.services.manager.planner import Move

    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        rm_a, rm_c = servers.rmanagers["a"], servers.rmanagers["c"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            for iid in ("c0", "c1"):
                await m.register_compute(ComputeInfo(iid, f"127.0.0.1:5007{iid[1]}", ("a",)))
            assert await m.place("w", 3, owner="c0") == [Grant("a", 3, (0, 1, 2))]
            assert await m.prefix.publish([("w", i, H[i], "a") for i in range(3)]) == 3
            assert await m.prefix.match("r", H[:3], owner="c1") == [Grant("a", 3, (0, 1, 2))]
            assert await m.prefix.match("x", H[:2], owner="c1") == [Grant("a", 2, (0, 1))]
            assert [rm_a.pool.ref_count(b) for b in (0, 1, 2)] == [3, 3, 2]

            order = await m.migrations.start(Move("r", "a", "c", 3, "lend"), "c1")
            assert m.migrations.take_orders("c1") == [order]
            # r's instance moves the three (what MigrationExecutor and ImportBlocks do): c's copies are cached
            # under the source's hashes, r's references on a are dropped.
            moved = [rm_c.commit(rid, [k])[0] for k, rid in enumerate(order.reservation_ids)]
            rm_c.cache_blocks("r", [(k, H[k]) for k in range(3)])
            rm_a.free_blocks("r", [0, 1, 2])
            await m.migrations.settle(
                MigrationResult(order.migration_id, "r", "a", "c", 3, 3, 300, cached_hashes=tuple(H[:3]))
            )
            await m.migrations.followed()  # the readers are followed in the background
            assert [m.prefix.index.server_of(h) for h in H[:3]] == ["c"] * 3
            assert await m.prefix.index.load() == 3 and m.prefix.blocks_per_server() == {"c": 3}  # etcd says so too
            (w_order,) = m.migrations.take_orders("c0")
            (x_order,) = m.migrations.take_orders("c1")
            assert (w_order.seq_id, w_order.block_indices, w_order.src, w_order.dst) == ("w", (0, 1, 2), "a", "c")
            assert (x_order.seq_id, x_order.block_indices) == ("x", (0, 1))
            assert [rm_c.pool.ref_count(b) for b in moved] == [3, 3, 2]  # r's, and w's and x's reservations
            assert rm_c.owned_blocks("w") == rm_c.owned_blocks("x") == []  # their tables change only at the flip
            ledger = (await m.cluster_state()).ledger
            assert (ledger["w"], ledger["x"], ledger["r"]) == ([("a", 0), ("c", 3)], [("a", 0), ("c", 2)], [("c", 3)])
            assert m.migrations.busy("w") and m.migrations.busy("x")

            # w's instance (MigrationExecutor._reattach): commit the reservation on c, free a's, flip.
            (rid,) = w_order.reservation_ids
            assert rm_c.commit(rid, [0, 1, 2]) == moved
            rm_a.free_blocks("w", [0, 1, 2])
            await m.migrations.settle(
                MigrationResult(w_order.migration_id, "w", "a", "c", 3, 3, block_indices=w_order.block_indices)
            )
            assert await m.migrations.expire(now=time.monotonic() + 1000) == 1  # x's instance never reported
            ledger = (await m.cluster_state()).ledger
            assert (ledger["w"], ledger["x"]) == ([("c", 3)], [("a", 2)])
            assert [rm_c.pool.ref_count(b) for b in moved] == [2, 2, 2]  # r and w
            assert [rm_a.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0]  # x still reads a's copies
            assert rm_c.owned_blocks("x") == [] and rm_c.pool.num_reserved == 0 and m.migrations.readers_moved == 3
            for seq_id in ("w", "r", "x"):
                await m.release(seq_id)
            assert (rm_a.pool.num_free, rm_c.pool.num_free, (await m.cluster_state()).ledger) == (8, 8, {})
            assert not m.migrations.in_flight

    asyncio.run(scenario())


async def _r_moves_what_it_shares_with_w(m, n: int):  # noqa: ANN001, ANN202
    """``w`` places and publishes ``n`` rBlocks on a, ``r`` attaches them (both owned by c0); r's move a -> c is
    started and carried out as r's instance does it (commit on c, cached there under the source's hashes, r's
    references on a dropped). Returns the move's result, not yet settled."""
    from infinite_llm.services.manager.migrations import MigrationResult
    from infinite_llm.services.manager.planner import Move

    await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
    await m.place("w", n, owner="c0")
    await m.prefix.publish([("w", i, H[i], "a") for i in range(n)])
    await m.prefix.match("r", H[:n], owner="c0")
    order = await m.migrations.start(Move("r", "a", "c", n, "lend"), "c0")
    for k, rid in enumerate(order.reservation_ids):
        await m.block_servers.commit("c", rid, [k])
    rm_a, rm_c = m.drains.servers.rmanagers["a"], m.drains.servers.rmanagers["c"]
    rm_c.cache_blocks("r", [(k, H[k]) for k in range(n)])
    rm_a.free_blocks("r", list(range(n)))
    return MigrationResult(order.migration_id, "r", "a", "c", n, n, cached_hashes=tuple(H[:n]))


def test_a_reader_whose_copy_was_evicted_on_the_destination_stays_on_the_source(etcd_server, etcd_prefix):
    """The destination evicted the moved copy before the reader's re-attach: the reservation comes back
    empty, so no order is made and the reader's ledger entry is as before."""

    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        rm_a, rm_c = servers.rmanagers["a"], servers.rmanagers["c"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            result = await _r_moves_what_it_shares_with_w(m, 2)
            await m.release("r")  # r ends: c's copies parked ...
            rm_c.clear_cache()  # ... and evicted
            await m.migrations.settle(result)
            await m.migrations.followed()
            assert m.migrations.take_orders("c0") == []
            assert (await m.cluster_state()).ledger == {"w": [("a", 2)]}
            assert rm_c.pool.num_free == 8 and [rm_a.pool.ref_count(b) for b in (0, 1)] == [1, 1]

    asyncio.run(scenario())


def test_no_reader_is_reattached_onto_a_draining_server(etcd_server, etcd_prefix):
    """Behind the autoscaler's DrainGuard: the move's destination began draining before the move settled, so
    the other reader is not attached there (it would have to leave again) and keeps reading the source."""
    from infinite_llm.services.manager.drain import DrainGuard

    async def scenario():
        local = make_servers({"a": 8, "c": 8})
        rm_a, rm_c = local.rmanagers["a"], local.rmanagers["c"]
        guard = DrainGuard(local)
        guard.rmanagers = local.rmanagers  # running_manager registers each of them
        async with running_manager(etcd_server, etcd_prefix, guard) as m:
            result = await _r_moves_what_it_shares_with_w(m, 2)
            guard.set_draining(frozenset({"c"}))
            await m.migrations.settle(result)
            await m.migrations.followed()
            assert m.migrations.take_orders("c0") == []
            assert (await m.cluster_state()).ledger == {"w": [("a", 2)], "r": [("c", 2)]}
            assert rm_c.owned_blocks("w") == [] and [rm_a.pool.ref_count(b) for b in (0, 1)] == [1, 1]
            for seq_id in ("w", "r"):
                await m.release(seq_id)
            assert (rm_a.pool.num_free, rm_c.pool.num_free) == (8, 8)

    asyncio.run(scenario())


def test_a_moved_prefix_with_more_readers_than_the_follow_concurrency_reattaches_every_one(etcd_server, etcd_prefix):
    """A system prompt read by many sequences: settling the move returns at once, and the readers (more than
    ``FOLLOW_CONCURRENCY`` of them, followed at most that many at a time in the background) each get one
    re-attach order with its ledger shifted and a reference held on the destination's copy."""
    from infinite_llm.services.manager.migrations import FOLLOW_CONCURRENCY

    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        rm_c = servers.rmanagers["c"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            result = await _r_moves_what_it_shares_with_w(m, 2)  # w reads them too
            readers = ["w"] + [f"q{i}" for i in range(2 * FOLLOW_CONCURRENCY)]
            for seq_id in readers[1:]:
                assert await m.prefix.match(seq_id, H[:2], owner="c0") == [Grant("a", 2, (0, 1))]
            await m.migrations.settle(result)
            await m.migrations.followed()
            orders = m.migrations.take_orders("c0")
            assert sorted((o.seq_id, o.block_indices, o.src, o.dst) for o in orders) == sorted(
                (s, (0, 1), "a", "c") for s in readers
            )
            ledger = (await m.cluster_state()).ledger
            assert all(ledger[s] == [("a", 0), ("c", 2)] for s in readers)
            copies = rm_c.owned_blocks("r")
            assert [rm_c.pool.ref_count(b) for b in copies] == [1 + len(readers)] * 2  # r's and each reservation
            for o in orders:  # the instances never report: every reservation is cancelled, every ledger goes back
                await m.migrations.settle(
                    MigrationResult(o.migration_id, o.seq_id, "a", "c", 2, 0, 0, "refused", block_indices=(0, 1))
                )
            assert [rm_c.pool.ref_count(b) for b in copies] == [1, 1] and rm_c.pool.num_reserved == 0
            ledger = (await m.cluster_state()).ledger
            assert all(ledger[s] == [("a", 2)] for s in readers)

    from infinite_llm.services.manager.migrations import MigrationResult

    asyncio.run(scenario())
