"""Place is idempotent per (seq_id, first_block_index): a retried Place whose reply was lost, or one that
meets a ledger ahead of the servers (a manager that died between the ledger write and the commit), leaves
the sequence holding each logical rBlock exactly once, on real rManagers, with the ledger in real etcd
matching them."""

from __future__ import annotations

import asyncio

from infinite_llm.core.rmanager import RManager
from infinite_llm.services.manager import Grant, LocalServers
from infinite_llm.services.manager.records import encode_ledger

from .helpers import make_servers, open_store, pool_state, running_manager


def _indices(rm: RManager, seq_id: str) -> list[int]:
    return sorted(rm._owned.get(seq_id, {}))


def _held(servers: LocalServers, seq_id: str) -> dict[str, list[int]]:
    """Logical rBlock indices of ``seq_id`` per server (servers holding none left out)."""
    return {sid: _indices(rm, seq_id) for sid, rm in servers.rmanagers.items() if _indices(rm, seq_id)}


def test_a_place_repeated_after_its_reply_was_lost_holds_each_logical_block_once(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 3, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            empty = pool_state(servers)
            first = await m.place("s", 4, near="a", first_index=0)
            assert first == [Grant("a", 3, (0, 1, 2)), Grant("b", 1, (0,))]
            assert _held(servers, "s") == {"a": [0, 1, 2], "b": [3]}
            again = await m.place("s", 4, near="a", first_index=0)  # the caller never saw ``first``
            assert sum(g.n_blocks for g in again) == 4
            assert _held(servers, "s") == {"a": [0, 1, 2], "b": [3]}  # each index once, 4 blocks in all
            assert sum(rm.pool.num_used for rm in servers.rmanagers.values()) == 4
            assert (await m.cluster_state()).ledger == {"s": [("a", 3), ("b", 1)]}
            # the next Place of the block table goes on from there
            assert [(g.server_id, g.n_blocks) for g in await m.place("s", 2, first_index=4)] == [("b", 2)]
            assert _held(servers, "s") == {"a": [0, 1, 2], "b": [3, 4, 5]}
            # a retry in the middle of the table drops everything from there
            await m.place("s", 1, first_index=2, near="a")
            assert _held(servers, "s") == {"a": [0, 1, 2]}
            assert (await m.cluster_state()).ledger == {"s": [("a", 3)]}
            assert [s.free_blocks for s in (await m.cluster_state()).members] == [0, 8]
            assert await m.release("s") == 3
            assert pool_state(servers) == empty

    asyncio.run(scenario())


def test_a_ledger_ahead_of_the_servers_is_corrected_before_placing(etcd_server, etcd_prefix):
    """The manager died after writing the ledger and before committing on the servers: the ledger counts 5
    rBlocks, the servers hold 2 (and 3 reserved, never committed)."""

    async def scenario():
        servers = make_servers({"a": 8, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, open_store(etcd_server, etcd_prefix) as raw:
            empty = pool_state(servers)
            await m.place("s", 2, near="a", first_index=0)
            lost = servers.rmanagers["b"].reserve("s", 3)
            await raw.put("ledger/s", encode_ledger([("a", 2), ("b", 3)], ""))
            grants = await m.place("s", 3, first_index=2, near="a")
            assert sum(g.n_blocks for g in grants) == 3
            assert sorted(i for held in _held(servers, "s").values() for i in held) == [0, 1, 2, 3, 4]
            ledger = dict((await m.cluster_state()).ledger["s"])
            assert ledger == {sid: len(held) for sid, held in _held(servers, "s").items()}
            servers.rmanagers["b"].cancel(lost.reservation_id)  # what reservation expiry does on a real server
            assert await m.release("s") == 5
            assert pool_state(servers) == empty

    asyncio.run(scenario())


class SlowServers(LocalServers):
    """Yields inside every reservation and commit, so two Places of one sequence would interleave."""

    async def reserve(self, server_id, seq_id, n):
        await asyncio.sleep(0.01)
        return await super().reserve(server_id, seq_id, n)

    async def commit(self, server_id, reservation_id, block_indices):
        await asyncio.sleep(0.01)
        return await super().commit(server_id, reservation_id, block_indices)


def test_a_retry_that_overtakes_the_first_place_waits_for_it(etcd_server, etcd_prefix):
    """Both arrive while the first is still placing (a connection cut mid-call): they run one after the
    other, and the sequence ends with one rBlock per logical index."""

    async def scenario():
        servers = SlowServers(make_servers({"a": 4, "b": 4}).rmanagers)
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            results = await asyncio.gather(*(m.place("s", 5, near="a", first_index=0) for _ in range(2)))
            assert [sum(g.n_blocks for g in r) for r in results] == [5, 5]
            assert sorted(i for held in _held(servers, "s").values() for i in held) == [0, 1, 2, 3, 4]
            assert sum(rm.pool.num_used for rm in servers.rmanagers.values()) == 5
            assert sum(rm.pool.num_reserved for rm in servers.rmanagers.values()) == 0
            assert sum(n for _, n in (await m.cluster_state()).ledger["s"]) == 5
            assert len(m._placing) == 0

    asyncio.run(scenario())
