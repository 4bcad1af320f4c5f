"""An attention server that stops on its own (SIGTERM) drains like one the autoscaler scales down: its
heartbeat says ``draining``, the manager places nothing new there, the planner's view and ``status`` show it,
and a registration or a heartbeat without the flag ends it. The server's side (:func:`drain`) waits for its
rBlocks to leave, and gives up on a stuck drain, a second signal, or a manager it cannot tell.
Real etcd, a real GlobalManager service on loopback, a real Registrar and a real ServedRManager."""

from __future__ import annotations

import asyncio
import time

import pytest

from infinite_llm.core.rmanager import KVLayout
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.services.attention.registrar import Registrar
from infinite_llm.services.attention.served_rmanager import ServedRManager
from infinite_llm.services.attention.server import drain
from infinite_llm.services.manager.drain import DrainGuard

from .helpers import LAYOUT, make_servers, running_manager, wait_for
from .test_compute_rpc import served


def beat(server_id: str, free: int, draining: bool) -> mpb.HeartbeatRequest:
    return mpb.HeartbeatRequest(server_id=server_id, free_blocks=free, draining=draining)


def test_the_union_of_the_autoscalers_set_and_the_servers_that_stop():
    guard = DrainGuard(make_servers({"a": 2, "b": 2, "c": 2}))
    guard.set_draining(frozenset({"a"}))
    assert guard.announce("b", True) is True
    assert guard.announce("b", True) is False  # already known
    assert guard.draining == {"a", "b"}
    guard.set_draining(frozenset())  # the autoscaler's set does not clear a server's own word
    assert guard.draining == {"b"}
    assert guard.announce("b", False) is True
    assert guard.draining == frozenset()


def test_a_stopping_server_gets_no_placement_until_it_says_otherwise(etcd_server, etcd_prefix):
    async def scenario():
        # b has the most room: placement would pick it first
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4, "b": 8})) as m, served(m) as stub:
            await stub.Heartbeat(beat("b", 8, draining=True))
            state = await stub.GetClusterState(mpb.ClusterStateRequest())
            assert {s.server_id: s.draining for s in state.servers} == {"a": False, "b": True}
            assert {s.server_id: s.draining for s in (await m.rebalancer.cluster_view()).servers} == {
                "a": False,
                "b": True,
            }
            placed = await stub.Place(mpb.PlaceRequest(seq_id="s1", num_blocks=3))
            assert [(g.server_id, len(g.block_ids)) for g in placed.grants] == [("a", 3)]
            await stub.Heartbeat(beat("b", 8, draining=False))  # the same server, not stopping after all
            placed = await stub.Place(mpb.PlaceRequest(seq_id="s2", num_blocks=3))
            assert [(g.server_id, len(g.block_ids)) for g in placed.grants] == [("b", 3)]
            await stub.Heartbeat(beat("b", 5, draining=True))
            await m.register("b", "b.local:50051", 8, LAYOUT.block_size)  # a new process under the same id
            assert m.drains.draining == frozenset()

    asyncio.run(scenario())


def test_status_marks_a_draining_server(etcd_server, etcd_prefix):
    from typer.testing import CliRunner

    from infinite_llm.cli import app

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4, "b": 4})) as m, served(m) as stub:
            await stub.Heartbeat(beat("b", 4, draining=True))
            argv = ["status", "--manager", stub.address, "--insecure"]
            return await asyncio.to_thread(CliRunner().invoke, app, argv, env={"COLUMNS": "250"})

    out = asyncio.run(scenario())
    assert out.exit_code == 0, out.output
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.output.splitlines()]
    assert [r[0] for r in rows if len(r) == 9] == ["a", "b (draining)"]


# ---- the server's side ---------------------------------------------------------------------------------
SERVER_LAYOUT = KVLayout(num_layers=1, block_size=LAYOUT.block_size, num_kv_heads=1, head_dim=2)


def holding(num_blocks: int, seqs: dict[str, int]) -> ServedRManager:
    """A real attention server's rManager of ``num_blocks`` rBlocks holding ``seqs[seq_id]`` rBlocks each."""
    holder = ServedRManager.with_capacity(num_blocks * SERVER_LAYOUT.bytes_per_block, SERVER_LAYOUT)
    for seq_id, n in seqs.items():
        reservation = holder.reserve(seq_id, n)
        holder.commit(reservation.reservation_id, list(range(n)))
    return holder


async def registered(stub, holder: ServedRManager, server_id: str = "b") -> Registrar:
    registrar = Registrar(stub.address, server_id, f"{server_id}.local:50051", LAYOUT.block_size, holder.stats)
    registrar.start()
    await asyncio.wait_for(registrar.registered.wait(), 10)
    return registrar


def test_drain_waits_until_the_rblocks_left_and_tells_the_manager(etcd_server, etcd_prefix):
    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4}), register=False) as m:
            await m.register("a", "a.local:50051", 4, LAYOUT.block_size)
            async with served(m) as stub:
                holder = holding(8, {"s1": 3, "s2": 2})
                registrar = await registered(stub, holder)
                try:
                    task = asyncio.create_task(drain(holder.stats, registrar, timeout_s=30, idle_s=5))
                    await wait_for(lambda: m.drains.draining == {"b"}, 5)  # (told at once: the next test)
                    assert not task.done()
                    holder.free_sequence("s1")  # as migrations and finished sequences free them
                    await asyncio.sleep(0.5)
                    assert not task.done()
                    holder.free_sequence("s2")
                    assert await asyncio.wait_for(task, 5) == 0
                    await asyncio.sleep(1.2)  # a periodic heartbeat: it still says draining
                    assert m.drains.draining == {"b"}
                finally:
                    await registrar.stop()

    asyncio.run(scenario())


def test_an_empty_server_stops_at_once_and_gets_nothing_new_meanwhile(etcd_server, etcd_prefix):
    """It still says it is stopping: until its lease runs out the manager neither places nor moves rBlocks
    onto a server that is gone."""

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m, served(m) as stub:
            holder = holding(8, {})
            registrar = await registered(stub, holder)
            try:
                assert await asyncio.wait_for(drain(holder.stats, registrar, timeout_s=30), 5) == 0
                assert m.drains.draining == {"b"}  # told by the drain itself, before it returned
            finally:
                await registrar.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["idle", "timeout", "second signal"])
def test_a_drain_that_cannot_finish_ends(etcd_server, etcd_prefix, how):
    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m, served(m) as stub:
            holder = holding(8, {"s1": 3, "s2": 2})
            registrar = await registered(stub, holder)
            now = asyncio.Event()
            limits = {"idle": (30, 0.6), "timeout": (0.6, 30), "second signal": (30, 30)}[how]
            try:
                start = time.monotonic()
                task = asyncio.create_task(drain(holder.stats, registrar, limits[0], now=now, idle_s=limits[1]))
                await asyncio.sleep(0.3)
                holder.free_sequence("s2")  # some progress, then none
                if how == "second signal":
                    await asyncio.sleep(0.3)
                    now.set()
                assert await asyncio.wait_for(task, 5) == 3
                took = time.monotonic() - start
                assert 0.6 <= took < 2.5, took
            finally:
                await registrar.stop()

    asyncio.run(scenario())


def test_a_manager_that_cannot_be_told_ends_the_drain_at_once(etcd_server, etcd_prefix):
    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m:
            async with served(m) as stub:
                holder = holding(8, {"s1": 3})
                registrar = await registered(stub, holder)
            # the manager's service is gone (its port closed): the drain's heartbeat cannot reach it
            try:
                start = time.monotonic()
                assert await drain(holder.stats, registrar, timeout_s=30) == 3
                assert time.monotonic() - start < 6
            finally:
                await registrar.stop()

    asyncio.run(scenario())


def test_the_planner_empties_a_stopping_server_with_drain_orders(etcd_server, etcd_prefix):
    """c0's sequence x spills off its home a onto a lender; that lender says it is stopping: the next planning
    tick moves x's rBlocks to the other lender, and the order c0 receives in its heartbeat reply is marked
    ``drain`` (it copies at its drain budget)."""
    from infinite_llm.services.manager.computes import ComputeInfo

    async def scenario():
        servers = make_servers({"a": 2, "b": 4, "c": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
            await m.place("x", 4, owner="c0")
            ledger = (await m.cluster_state()).ledger["x"]
            (lender, n), *rest = [(s, k) for s, k in ledger if s != "a"]
            assert (n, rest) == (2, [])
            other = ({"b", "c"} - {lender}).pop()
            await stub.Heartbeat(beat(lender, 2, draining=True))
            assert await m.rebalancer.tick() == 1
            reply = await stub.HeartbeatCompute(mpb.HeartbeatComputeRequest(instance_id="c0"))
            (order,) = reply.migrations
            assert (order.seq_id, order.src_server_id, order.dst_server_id, len(order.reservation_ids)) == (
                "x",
                lender,
                other,
                2,
            )
            assert order.drain

    asyncio.run(scenario())


def test_a_stopped_server_deregisters_instead_of_waiting_for_its_lease(etcd_server, etcd_prefix):
    """After its drain the server leaves at once: the manager no longer lists it (nor places on or moves to
    it), instead of for the rest of its lease; leaving twice is NOT_FOUND, which the registrar shrugs off."""
    import grpc

    from .helpers import wait_for

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m, served(m) as stub:
            holder = holding(8, {})
            registrar = await registered(stub, holder)
            assert "b" in {x.info.server_id for x in m.members()}
            await registrar.stop()
            await registrar.deregister()
            await wait_for(lambda: "b" not in {x.info.server_id for x in m.members()}, 5)  # its lease is 10 s
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Deregister(mpb.DeregisterRequest(server_id="b"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            await registrar.deregister()  # logged, not raised

    asyncio.run(scenario())
