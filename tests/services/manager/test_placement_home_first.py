"""Placement home-first and lending by plan, and the manager's half of a migration, with real etcd and real
rManagers: new rBlocks go to the owner's homes, then to servers nobody calls home, never to a server whose
owner is itself borrowing; a move reserves the destination, shifts the ledger, and settles what moved."""

from __future__ import annotations

import asyncio
import time

import pytest

from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.services.manager import GlobalManager, ManagerConfig
from infinite_llm.services.manager import migrations as migrations_module
from infinite_llm.services.manager.computes import ComputeInfo, ComputeLoad
from infinite_llm.services.manager.drain import DrainGuard
from infinite_llm.services.manager.migrations import MigrationResult
from infinite_llm.services.manager.planner import Move, plan

from .helpers import LAYOUT, make_servers, open_store, pool_state, running_manager


async def _two_instances(m) -> None:
    await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
    await m.register_compute(ComputeInfo("c1", "127.0.0.1:50071", ("b",)))


async def _c0_in_debt(m) -> None:
    """c0's home a (10 rBlocks) full with a1 (6) and a2 (4), and 2 requests waiting: a debtor."""
    await _two_instances(m)
    await m.place("a1", 6, owner="c0")
    await m.place("a2", 4, owner="c0", first_index=0)
    await m.heartbeat_compute("c0", ComputeLoad(2, 2, 2 * 5 * 4))


def _shares(grants) -> list[tuple[str, int]]:
    return [(g.server_id, g.n_blocks) for g in grants]


def test_new_rblocks_go_home_first_then_to_servers_nobody_calls_home(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 8, "c": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _two_instances(m)
            assert _shares(await m.place("s1", 3, owner="c0")) == [("a", 3)]
            # Home holds 1 more; the rest goes to c (nobody's home) before b (c1's home), though b is as free.
            assert _shares(await m.place("s1", 3, owner="c0", first_index=3)) == [("a", 1), ("c", 2)]
            assert _shares(await m.place("s2", 5, owner="c1")) == [("b", 5)]
            state = await m.cluster_state()
            assert state.ledger == {"s1": [("a", 4), ("c", 2)], "s2": [("b", 5)]}
            assert [(c.info.instance_id, c.debt_blocks) for c in state.computes] == [("c0", 2), ("c1", 0)]

    asyncio.run(scenario())


def test_no_chains_a_borrowers_home_lends_nothing_until_it_stops_borrowing(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 8, "c": 2})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _two_instances(m)
            assert _shares(await m.place("s3", 8, owner="c1")) == [("b", 8)]  # c1's home b is full,
            assert _shares(await m.place("s2", 1, owner="c1")) == [("c", 1)]  # so c1 borrows,
            await m.release("s3")  # and still does once b is free again
            assert _shares(await m.place("s1", 5, owner="c0")) == [("a", 4), ("c", 1)]
            before = pool_state(servers)
            with pytest.raises(CapacityExhausted):  # b has 8 free, but its owner c1 borrows
                await m.place("s1", 2, owner="c0", first_index=5)
            assert pool_state(servers) == before  # nothing reserved, nothing leaked
            await m.release("s2")  # c1 borrows no more: c (nobody's home, 1 free) first, then its home b
            assert _shares(await m.place("s1", 2, owner="c0", first_index=5)) == [("c", 1), ("b", 1)]
            # An anonymous placement (no owner) is not bound by homes: near first, then most free.
            assert _shares(await m.place("x", 2, near="a")) == [("b", 2)]

    asyncio.run(scenario())


def test_move_reserves_the_destination_shifts_the_ledger_and_settles_what_moved(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
            await m.place("s1", 5, owner="c0")
            order = await m.migrations.start(Move("s1", "a", "c", 3, "lend"), "c0")
            assert (order.src, order.dst, order.src_address, order.dst_address) == (
                "a",
                "c",
                "a.local:50051",
                "c.local:50051",
            )
            assert len(order.reservation_ids) == 3 and servers.rmanagers["c"].pool.num_reserved == 3
            assert (await m.cluster_state()).ledger == {"s1": [("a", 2), ("c", 3)]}
            assert m.migrations.take_orders("c0") == [order] and m.migrations.take_orders("c0") == []
            assert m.migrations.busy("s1")
            # The compute instance moved logical rBlock 0, then failed: commit on c, free on a (as it does).
            rm_a, rm_c = servers.rmanagers["a"], servers.rmanagers["c"]
            rm_c.commit(order.reservation_ids[0], [0])
            rm_a.free_blocks("s1", [0])
            await m.migrations.settle(MigrationResult(order.migration_id, "s1", "a", "c", 3, 1, 100, "UNAVAILABLE"))
            assert (await m.cluster_state()).ledger == {"s1": [("a", 4), ("c", 1)]}
            assert (rm_a.pool.num_used, rm_c.pool.num_used, rm_c.pool.num_reserved) == (4, 1, 0)
            assert (m.migrations.migrations_total, m.migrations.blocks_moved, m.migrations.bytes_moved) == (1, 1, 100)
            assert not m.migrations.busy("s1")
            await m.release("s1")
            assert (rm_a.pool.num_free, rm_c.pool.num_free) == (8, 8)

    asyncio.run(scenario())


def test_a_refused_reservation_starts_no_move_and_changes_nothing(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8, "c": 2})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
            await m.place("s1", 5, owner="c0")
            before = pool_state(servers)
            assert await m.migrations.start(Move("s1", "a", "c", 3, "lend"), "c0") is None  # c has only 2
            assert await m.migrations.start(Move("s1", "a", "c", 6, "lend"), "c0") is None  # a holds only 5
            assert pool_state(servers) == before
            assert (await m.cluster_state()).ledger == {"s1": [("a", 5)]}
            assert m.migrations.take_orders("c0") == []

    asyncio.run(scenario())


def test_planner_tick_orders_the_debtors_best_move(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 10, "b": 10})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _c0_in_debt(m)
            await m.place("b1", 1, owner="c1")
            await m.heartbeat_compute("c1", ComputeLoad(1, 0, 4))
            view = await m.rebalancer.cluster_view()
            assert [(s.server_id, s.free_blocks) for s in view.servers] == [("a", 0), ("b", 9)]
            expected = plan(view, m.rebalancer.config)
            assert [(mv.seq_id, mv.src, mv.dst, mv.reason) for mv in expected] == [("a1", "a", "b", "lend")]
            assert await m.rebalancer.tick() == 1
            (order,) = m.migrations.take_orders("c0")
            assert (order.seq_id, order.src, order.dst, len(order.reservation_ids)) == (
                "a1", "a", "b", expected[0].n_blocks,
            )  # fmt: skip
            assert await m.rebalancer.tick() == 0  # the move in flight counts as done: c0 is no debtor now

    asyncio.run(scenario())


def test_a_draining_server_is_emptied_by_migration_orders(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 8, "c": 8})
        guard = DrainGuard(servers)  # the manager's BlockServers when autoscaling is on, as serve() wires it
        async with open_store(etcd_server, etcd_prefix) as store:
            m = GlobalManager(store, guard, ManagerConfig("m1", block_size=LAYOUT.block_size))
            await m.start(acquire_timeout_s=10)
            try:
                for sid, rm in servers.rmanagers.items():
                    await m.register(sid, f"{sid}.local:50051", rm.pool.num_blocks, LAYOUT.block_size)
                await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
                await m.place("s1", 4, owner="c0")
                await m.place("s1", 3, owner="c0", first_index=4)  # a full: 3 on b (nobody's home, most free)
                guard.set_draining(frozenset({"b"}))
                assert await m.rebalancer.tick() == 1
                (order,) = m.migrations.take_orders("c0")
                assert (order.src, order.dst, len(order.reservation_ids)) == ("b", "c", 3)
                assert guard.in_flight("c") == 3
                assert (await m.cluster_state()).ledger == {"s1": [("a", 4), ("b", 0), ("c", 3)]}
                # The compute instance moved all 3; settling drops b from the ledger and the guard's count.
                for i, rid in enumerate(order.reservation_ids):
                    servers.rmanagers["c"].commit(rid, [4 + i])
                servers.rmanagers["b"].free_blocks("s1", [4, 5, 6])
                await m.migrations.settle(MigrationResult(order.migration_id, "s1", "b", "c", 3, 3))
                assert (await m.cluster_state()).ledger == {"s1": [("a", 4), ("c", 3)]}
                assert guard.in_flight("c") == 0 and servers.rmanagers["b"].pool.num_free == 8
            finally:
                await m.stop()

    asyncio.run(scenario())


def test_an_order_without_a_result_expires_and_a_late_result_changes_nothing(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
            await m.place("s1", 5, owner="c0")
            order = await m.migrations.start(Move("s1", "a", "c", 2, "lend"), "c0")
            assert await m.migrations.expire(now=time.monotonic() + 60) == 0
            assert await m.migrations.expire(now=time.monotonic() + 121) == 1
            assert (await m.cluster_state()).ledger == {"s1": [("a", 5)]}
            assert servers.rmanagers["c"].pool.num_free == 8 and not m.migrations.in_flight
            late = MigrationResult(order.migration_id, "s1", "a", "c", 2, 2, 10)
            await m.migrations.settle(late)  # settled already: ignored
            assert (await m.cluster_state()).ledger == {"s1": [("a", 5)]}
            assert m.migrations.migrations_total == 0

    asyncio.run(scenario())


def test_a_sequence_whose_move_failed_is_not_planned_again_until_its_backoff_runs_out(
    etcd_server, etcd_prefix, monkeypatch
):
    """A refused order (a preempted sequence) is not re-ordered at every tick: back-off, doubled per failure.
    The back-off starts inside ``settle``, which then waits on RPCs: the test bounds that instant by the times
    before and after ``failed_order`` instead of assuming it returns at once (a loaded CI machine took >0.2 s)."""
    monkeypatch.setattr(migrations_module, "RETRY_BACKOFF_S", 1.0)

    async def failed_order(m) -> None:
        assert await m.rebalancer.tick() == 1
        (order,) = m.migrations.take_orders("c0")
        refused = MigrationResult(order.migration_id, "a1", "a", "b", order.num_blocks, 0, 0,
                                  "the sequence is no longer running")  # fmt: skip
        await m.migrations.settle(refused)

    async def scenario():
        servers = make_servers({"a": 10, "b": 10})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await _c0_in_debt(m)
            await m.heartbeat_compute("c1", ComputeLoad(0, 0, 0))
            await failed_order(m)
            after = time.monotonic()  # the back-off began before this: it runs out by after + 1 s
            assert (await m.cluster_state()).ledger["a1"] == [("a", 6)]  # nothing moved, nothing reserved
            assert servers.rmanagers["b"].pool.num_free == 10
            assert await m.rebalancer.tick() == 0  # the same move is wanted, but a1 backs off
            assert m.migrations.backing_off("a1") and not m.migrations.backing_off("a2")
            await asyncio.sleep(after + 1.1 - time.monotonic())
            before = time.monotonic()
            await failed_order(m)  # planned again once the back-off ran out; refused again
            after = time.monotonic()  # the doubled back-off (2 s) began between before and after
            assert m.migrations.backing_off("a1", now=before + 1.9)
            assert not m.migrations.backing_off("a1", now=after + 2.1)
            await asyncio.sleep(after + 2.1 - time.monotonic())
            assert await m.rebalancer.tick() == 1
            (order,) = m.migrations.take_orders("c0")
            for i, rid in enumerate(order.reservation_ids):  # this time the instance moves them
                servers.rmanagers["b"].commit(rid, [i])
            servers.rmanagers["a"].free_blocks("a1", list(range(order.num_blocks)))
            await m.migrations.settle(
                MigrationResult(order.migration_id, "a1", "a", "b", order.num_blocks, order.num_blocks, 10)
            )
            assert not m.migrations.backing_off("a1", now=time.monotonic())  # a move that moved clears it

    asyncio.run(scenario())


def test_near_is_taken_first_among_homes_and_ignored_outside_them(etcd_server, etcd_prefix):
    """A growing sequence names the server of its last rBlock (``near``): the manager keeps it there while
    that home has room, though another home is freer, so its KV spans as few servers as it fits; a
    ``near`` that is not one of the owner's homes never beats home-first."""

    async def scenario():
        servers = make_servers({"a": 6, "b": 6, "c": 6})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a", "b")))
            assert _shares(await m.place("s1", 3, owner="c0")) == [("a", 3)]  # a tie: by server id
            assert _shares(await m.place("s1", 1, owner="c0", first_index=3)) == [("b", 1)]  # most free home
            assert _shares(await m.place("s1", 2, near="a", owner="c0", first_index=4)) == [("a", 2)]
            # a holds 1 more: near first, the rest on the other home
            assert _shares(await m.place("s1", 3, near="a", owner="c0", first_index=6)) == [("a", 1), ("b", 2)]
            # c is nobody's home and freest, but c0's home b has room: near=c is ignored
            assert _shares(await m.place("s2", 1, near="c", owner="c0")) == [("b", 1)]
            # no owner: not bound by homes, near first
            assert _shares(await m.place("x", 1, near="c")) == [("c", 1)]

    asyncio.run(scenario())
