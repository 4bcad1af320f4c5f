"""Orphan reconciliation against a real etcd and real rManagers: what is reclaimed, what never is."""

from __future__ import annotations

import asyncio

from infinite_llm.services.manager.computes import ComputeInfo
from infinite_llm.services.manager.reconcile import Orphan, Reconciler, ServerReport

from .helpers import make_servers, pool_state, running_manager


def _report(reconciler: Reconciler, servers) -> None:
    """Every server's heartbeat report, read from its rManager as the attention server does."""
    for sid, rm in servers.rmanagers.items():
        held = {s: len(rm.owned_blocks(s)) for s in rm.sequences() if rm.owned_blocks(s)}
        reserved: dict[str, int] = {}
        for rid, seq_id in rm._pending.items():
            reserved[seq_id] = reserved.get(seq_id, 0) + len(rm.pool.reserved_ids(rid))
        reconciler.reports.server(sid, ServerReport(held, reserved))


def test_entries_of_a_compute_instance_whose_lease_is_gone_are_released_on_the_second_pass(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c1", "10.0.1.1:1"))
            await m.register_compute(ComputeInfo("c2", "10.0.1.2:1"))
            await m.place("s1", 5, owner="c1")
            await m.place("s2", 3, owner="c2")
            await m.place("anon", 2)  # no owner: left to whoever placed it
            await m.deregister_compute("c1")  # as a crash once its lease expired
            r = Reconciler(m, servers)
            assert await r.run_once() == []  # suspected only
            assert await r.run_once() == [Orphan("owner_gone", "s1")]
            assert (await m.cluster_state()).ledger == {"anon": [("b", 2)], "s2": [("b", 3)]}
            assert {sid: sorted(state[2]) for sid, state in pool_state(servers).items()} == {
                "a": [],
                "b": ["anon", "s2"],
            }
            assert servers.rmanagers["a"].pool.num_free == 8 and servers.rmanagers["b"].pool.num_free == 3
            assert await r.run_once() == [] and r.reclaimed == {"owner_gone": 1}

    asyncio.run(scenario())


def test_an_entry_its_live_owner_stops_reporting_is_released_after_two_newer_reports(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c1", "10.0.1.1:1"))
            await m.place("lost", 2, owner="c1")  # its Release never reached the manager
            await m.place("live", 3, owner="c1")
            r = Reconciler(m, servers)
            r.reports.compute("c1", ["live", "lost"])
            assert await r.run_once() == []
            r.reports.compute("c1", ["live"])  # a report after that pass read the ledger
            assert await r.run_once() == []  # suspected
            assert await r.run_once() == []  # no newer report: not confirmed
            r.reports.compute("c1", ["live"])
            assert await r.run_once() == [Orphan("not_reported", "lost")]
            assert (await m.cluster_state()).ledger == {"live": [("a", 3)]}
            assert servers.rmanagers["a"].sequences() == ["live"] and servers.rmanagers["a"].pool.num_free == 5

    asyncio.run(scenario())


def test_a_listed_or_regrown_sequence_is_never_reclaimed(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c1", "10.0.1.1:1"))
            await m.place("s", 1, owner="c1")
            r = Reconciler(m, servers)
            await r.run_once()
            r.reports.compute("c1", [])  # a stale report that missed it...
            assert await r.run_once() == []
            await m.place("s", 1, first_index=1, owner="c1")  # ...but it grew: a new ledger revision
            r.reports.compute("c1", [])
            assert await r.run_once() == []
            for _ in range(3):
                r.reports.compute("c1", ["s"])
                assert await r.run_once() == []
            assert (await m.cluster_state()).ledger == {"s": [("a", 2)]}

    asyncio.run(scenario())


def test_server_blocks_and_reservations_with_no_ledger_entry_are_freed_there(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.place("kept", 2, near="a")
            rm_a, rm_b = servers.rmanagers["a"], servers.rmanagers["b"]
            rm_a.allocate("ghost", [0, 1, 2])  # committed after a ledger write that was lost
            rm_b.reserve("half", 2)  # a manager died between reserve and the ledger write
            r = Reconciler(m, servers)
            _report(r, servers)
            assert await r.run_once() == []
            _report(r, servers)
            reclaimed = await r.run_once()
            assert sorted(reclaimed, key=lambda o: o.seq_id) == [
                Orphan("unledgered", "ghost", "a"),
                Orphan("unledgered", "half", "b"),
            ]
            assert rm_a.sequences() == ["kept"] and rm_a.pool.num_free == 6
            assert rm_b.pool.num_free == 8 and rm_b.pool.num_reserved == 0
            assert r.reclaimed == {"unledgered": 3}
            assert (await m.cluster_state()).ledger == {"kept": [("a", 2)]}

    asyncio.run(scenario())


def test_a_sequences_rblocks_on_a_server_its_ledger_entry_does_not_name_are_freed_there_only(etcd_server, etcd_prefix):
    """A leftover beside a live sequence (its release could not reach the server, then it was placed again
    elsewhere): freed on that server; the sequence's rBlocks where its entry says stay."""

    async def scenario():
        servers = make_servers({"a": 8, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c1", "10.0.1.1:1"))
            await m.place("s", 2, near="a", owner="c1")
            rm_a, rm_b = servers.rmanagers["a"], servers.rmanagers["b"]
            rm_b.allocate("s", [1, 2])  # the leftover
            r = Reconciler(m, servers)
            for expected in ([], [Orphan("unledgered", "s", "b")], []):
                r.reports.compute("c1", ["s"])
                _report(r, servers)
                assert await r.run_once() == expected
            assert (rm_a.owned_blocks("s"), rm_b.sequences(), rm_b.pool.num_free) == ([0, 1], [], 8)
            assert (await m.cluster_state()).ledger == {"s": [("a", 2)]} and r.reclaimed == {"unledgered": 2}

    asyncio.run(scenario())


def test_a_follower_reclaims_nothing(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers, "m1") as leader:
            await leader.place("s", 2, owner="gone")
            async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False, lead=False) as f:
                r = Reconciler(f, servers)
                assert not f.is_leader
                assert [await r.run_once() for _ in range(3)] == [[], [], []]
            assert (await leader.cluster_state()).ledger == {"s": [("a", 2)]}

    asyncio.run(scenario())


def test_a_new_leader_gives_members_one_lease_period_to_register_again(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.place("s", 2, owner="c1")  # c1 has not registered again yet after a manager restart
            r = Reconciler(m, servers, settle_s=60.0)
            assert [await r.run_once() for _ in range(3)] == [[], [], []]
            r.settle_s = 0.0
            assert await r.run_once() == []  # suspected only now
            assert await r.run_once() == [Orphan("owner_gone", "s")]

    asyncio.run(scenario())
