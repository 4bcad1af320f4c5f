"""The compute-instance RPCs of the GlobalManager service on loopback over real etcd: status codes for bad
input, unknown and expired instances, and followers; the cluster state as operators read it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc
import pytest

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import tensor_pb2 as tpb
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.errors import error_from_rpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.manager.servicer import GlobalManagerServicer

from .helpers import make_servers, running_manager


@contextlib.asynccontextmanager
async def served(manager):
    """``manager`` behind a GlobalManager gRPC server on a free loopback port; yields a stub (its ``address``
    attribute: the server's ``host:port``; ``servicer``: the servicer, with its metrics)."""
    servicer = GlobalManagerServicer(manager)
    service = Service.of(mpb, "GlobalManager", mgrpc.add_GlobalManagerServicer_to_server, servicer)
    server = await start_server([service], "127.0.0.1:0")
    channel = aio_channel(f"127.0.0.1:{server.port}")
    try:
        stub = mgrpc.GlobalManagerStub(channel)
        stub.address = f"127.0.0.1:{server.port}"
        stub.servicer = servicer
        yield stub
    finally:
        await channel.close()
        await server.stop(0)


async def refused(call, request) -> tuple[grpc.StatusCode, str | None]:
    """The status code and the ``param`` the error names (from its trailing metadata)."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(request)
    return e.value.code(), error_from_rpc(e.value).param


REGISTER = dict(instance_id="c0", address="127.0.0.1:50070", home_server_ids=["a"])


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"instance_id": ""}, "instance_id"),
        ({"instance_id": "c/0"}, "instance_id"),
        ({"instance_id": "x" * 257}, "instance_id"),
        ({"address": ""}, "address"),
        ({"address": "127.0.0.1"}, "address"),
        ({"address": "127.0.0.1:0"}, "address"),
        ({"home_server_ids": ["a", ""]}, "home_server_ids"),
        ({"node_name": "node 1"}, "node_name"),
    ],
)
def test_register_compute_refuses_bad_input_with_invalid_argument(etcd_server, etcd_prefix, fields, param):
    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m, served(m) as stub:
            request = mpb.RegisterComputeRequest(**{**REGISTER, **fields})
            assert await refused(stub.RegisterCompute, request) == (grpc.StatusCode.INVALID_ARGUMENT, param)
            assert (await stub.ListComputeInstances(mpb.ListComputeInstancesRequest())).instances == []

    asyncio.run(scenario())


def test_registrations_carry_the_kv_layout_and_one_unlike_the_clusters_is_failed_precondition(etcd_server, etcd_prefix):
    fp32 = tpb.KVLayout(num_layers=30, block_size=4, num_kv_heads=3, head_dim=64, dtype="float32")
    bf16 = tpb.KVLayout(num_layers=30, block_size=4, num_kv_heads=3, head_dim=64, dtype="bfloat16")

    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False) as m, served(m) as stub:
            await stub.Register(mpb.RegisterRequest(server_id="a", address="127.0.0.1:50061", capacity_blocks=4,
                                                    block_size=4, layout=fp32))  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER, layout=bf16))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "compute instance 'c0' needs KV as bfloat16 for 30 layers x 3 KV heads x 64" in e.value.details()
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER, layout=fp32))
            assert [
                i.instance_id for i in (await stub.ListComputeInstances(mpb.ListComputeInstancesRequest())).instances
            ] == ["c0"]

    asyncio.run(scenario())


def test_heartbeat_and_deregister_of_unknown_or_bad_instances(etcd_server, etcd_prefix):
    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m, served(m) as stub:
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER))
            beat = mpb.HeartbeatComputeRequest
            assert await refused(stub.HeartbeatCompute, beat(instance_id="c9")) == (
                grpc.StatusCode.NOT_FOUND,
                "instance_id",
            )
            assert await refused(stub.HeartbeatCompute, beat()) == (grpc.StatusCode.INVALID_ARGUMENT, "instance_id")
            assert await refused(stub.HeartbeatCompute, beat(instance_id="c0", num_waiting=-1)) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "num_waiting",
            )
            await stub.HeartbeatCompute(beat(instance_id="c0", num_running=2, num_waiting=1, num_tokens_held=40))
            reply = await stub.ListComputeInstances(mpb.ListComputeInstancesRequest())
            assert [(i.instance_id, i.num_running, i.num_waiting, i.num_tokens_held) for i in reply.instances] == [
                ("c0", 2, 1, 40)
            ]
            drop = mpb.DeregisterComputeRequest
            assert await refused(stub.DeregisterCompute, drop(instance_id="c9")) == (
                grpc.StatusCode.NOT_FOUND,
                "instance_id",
            )
            await stub.DeregisterCompute(drop(instance_id="c0"))
            assert await refused(stub.HeartbeatCompute, beat(instance_id="c0")) == (
                grpc.StatusCode.NOT_FOUND,
                "instance_id",
            )
            assert (await stub.ListComputeInstances(mpb.ListComputeInstancesRequest())).instances == []

    asyncio.run(scenario())


def test_a_follower_refuses_registration_with_unavailable_and_lists_what_the_leader_registered(
    etcd_server, etcd_prefix
):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as leader, served(leader) as to_leader:
            async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False, lead=False) as f:
                async with served(f) as to_follower:
                    code, _ = await refused(to_follower.RegisterCompute, mpb.RegisterComputeRequest(**REGISTER))
                    assert code == grpc.StatusCode.UNAVAILABLE
                    await to_leader.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER))
                    for _ in range(100):
                        listed = await to_follower.ListComputeInstances(mpb.ListComputeInstancesRequest())
                        if listed.instances:
                            break
                        await asyncio.sleep(0.05)
                    assert [i.instance_id for i in listed.instances] == ["c0"]

    asyncio.run(scenario())


def test_cluster_state_names_each_sequence_owner_and_each_instance_debt(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER))  # home: a
            await stub.Place(mpb.PlaceRequest(seq_id="s1", num_blocks=6, near_server_id="a", instance_id="c0"))
            await stub.Place(mpb.PlaceRequest(seq_id="s2", num_blocks=1, near_server_id="b"))
            assert await refused(stub.Place, mpb.PlaceRequest(seq_id="s3", num_blocks=1, instance_id="c 0")) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "instance_id",
            )
            state = await stub.GetClusterState(mpb.ClusterStateRequest())
            assert [(e.seq_id, e.instance_id) for e in state.ledger] == [("s1", "c0"), ("s2", "")]
            (c0,) = state.compute_instances
            assert (c0.instance_id, list(c0.home_server_ids), c0.debt_blocks) == ("c0", ["a"], 2)

    asyncio.run(scenario())


def test_status_shows_a_home_the_manager_does_not_list_as_down(etcd_server, etcd_prefix):
    """``infinite-llm status`` against the served manager: of c0's named homes, a is live, b has left
    (deregistered) and gone never registered; the homes column says which are down."""
    from typer.testing import CliRunner

    from infinite_llm.cli import app

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4, "b": 4})) as m, served(m) as stub:
            await stub.RegisterCompute(
                mpb.RegisterComputeRequest(**{**REGISTER, "home_server_ids": ["a", "b", "gone"]})
            )
            await m.deregister("b")
            argv = ["status", "--manager", stub.address, "--insecure"]
            return await asyncio.to_thread(CliRunner().invoke, app, argv, env={"COLUMNS": "250"})

    out = asyncio.run(scenario())
    assert out.exit_code == 0, out.output
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.output.splitlines()]
    (c0,) = [r for r in rows if r and r[0] == "c0"]
    assert c0[:4] == ["c0", "127.0.0.1:50070", "-", "a, b (down), gone (down)"]
    assert [r[0] for r in rows if len(r) == 9] == ["a"]  # the attention servers' table: a alone


def test_a_shared_blocks_readers_follow_it_over_heartbeats(etcd_server, etcd_prefix):
    """The wire path of issue 13's shared-block migration: a move result carrying the moved hashes arrives in
    a heartbeat; the other reader's instance (a real ComputeRegistrar, here without a migration executor)
    receives its re-attach order in its heartbeat reply and reports it refused; the manager then cancels the
    reservation of the reader's references on the destination and puts its ledger entry back on the source."""
    from infinite_llm.core.prefix_cache import block_hashes
    from infinite_llm.services.compute.registrar import ComputeLoadReport, ComputeRegistrar
    from infinite_llm.services.manager.planner import Move

    hashes = block_hashes(list(range(8)), 4, "m")

    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        rm_a, rm_c = servers.rmanagers["a"], servers.rmanagers["c"]
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**{**REGISTER, "instance_id": "c1"}))
            load = lambda: ComputeLoadReport(1, 0, 8)  # noqa: E731
            w_instance = ComputeRegistrar(stub.address, "c0", "127.0.0.1:50070", load, ("a",))
            try:
                await w_instance._register()
                await m.place("w", 2, owner="c0")
                await m.prefix.publish([("w", i, hashes[i], "a") for i in range(2)])
                await m.prefix.match("r", hashes, owner="c1")
                order = await m.migrations.start(Move("r", "a", "c", 2, "lend"), "c1")
                for k, rid in enumerate(order.reservation_ids):
                    rm_c.commit(rid, [k])
                rm_c.cache_blocks("r", [(k, hashes[k]) for k in range(2)])
                rm_a.free_blocks("r", [0, 1])
                moved = mpb.MigrationResult(
                    migration_id=order.migration_id, seq_id="r", src_server_id="a", dst_server_id="c", num_blocks=2,
                    num_moved=2, bytes_moved=200, cached_hashes=hashes,
                )  # fmt: skip
                await stub.HeartbeatCompute(mpb.HeartbeatComputeRequest(instance_id="c1", migration_results=[moved]))
                await m.migrations.followed()  # the readers are followed in the background
                assert (await m.cluster_state()).ledger["w"] == [("a", 0), ("c", 2)]
                c_copies = rm_c.owned_blocks("r")
                assert [rm_c.pool.ref_count(b) for b in c_copies] == [2, 2]  # r's, and the reservation for w
                await w_instance._heartbeat()  # gets the re-attach order; no executor: refused, reported next
                await w_instance._heartbeat()
                assert (await m.cluster_state()).ledger["w"] == [("a", 2)]
                assert [rm_c.pool.ref_count(b) for b in c_copies] == [1, 1]
                assert rm_c.owned_blocks("w") == [] and rm_a.owned_blocks("w") == [0, 1]
                assert not m.migrations.in_flight
            finally:
                await w_instance.stop(deregister=False)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "fields",
    [
        {"num_moved": -1},
        {"num_moved": 3},  # more than the order's 2
        {"bytes_moved": -5},
        {"num_moved": 2, "cached_hashes": [b"short", b"x" * 32]},
        {"num_moved": 1, "cached_hashes": [b"x" * 32, b"y" * 32]},  # more hashes than rBlocks moved
        {"num_moved": 2, "block_indices": [0, -1]},
        {"seq_id": "other"},  # contradicts the order in flight
        {"dst_server_id": "a", "src_server_id": "c"},
    ],
)
def test_a_malformed_migration_result_is_refused_and_settles_nothing(etcd_server, etcd_prefix, fields):
    """A heartbeat carrying a malformed result gets INVALID_ARGUMENT (``migration_results``) and nothing of it
    is settled: the ledger shift and the destination's reservations stay as the order left them, and the
    well-formed result that follows settles the order."""
    from infinite_llm.services.manager.planner import Move

    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER))
            await m.place("s", 4, owner="c0")
            order = await m.migrations.start(Move("s", "a", "c", 2, "lend"), "c0")
            good = dict(
                migration_id=order.migration_id, seq_id="s", src_server_id="a", dst_server_id="c", num_blocks=2,
                num_moved=0, error="UNAVAILABLE: the source went away",
            )  # fmt: skip
            bad = mpb.MigrationResult(**{**good, **fields})
            beat = mpb.HeartbeatComputeRequest(instance_id="c0", migration_results=[bad])
            assert await refused(stub.HeartbeatCompute, beat) == (grpc.StatusCode.INVALID_ARGUMENT, "migration_results")
            assert (await m.cluster_state()).ledger["s"] == [("a", 2), ("c", 2)]
            assert servers.rmanagers["c"].pool.num_free == 6 and order.migration_id in m.migrations.in_flight
            ok = mpb.HeartbeatComputeRequest(instance_id="c0", migration_results=[mpb.MigrationResult(**good)])
            await stub.HeartbeatCompute(ok)
            assert (await m.cluster_state()).ledger["s"] == [("a", 4)]
            assert servers.rmanagers["c"].pool.num_free == 8 and not m.migrations.in_flight

    asyncio.run(scenario())


def test_only_the_instance_an_order_was_handed_to_may_report_its_result(etcd_server, etcd_prefix):
    """Compute instance c1 reports a result of c0's migration order: PERMISSION_DENIED, nothing settled; c0's
    own report settles it."""
    from infinite_llm.services.manager.planner import Move

    async def scenario():
        servers = make_servers({"a": 8, "c": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            for iid in ("c0", "c1"):
                await stub.RegisterCompute(mpb.RegisterComputeRequest(**{**REGISTER, "instance_id": iid}))
            await m.place("s", 4, owner="c0")
            order = await m.migrations.start(Move("s", "a", "c", 2, "lend"), "c0")
            result = mpb.MigrationResult(
                migration_id=order.migration_id, seq_id="s", src_server_id="a", dst_server_id="c", num_blocks=2,
                num_moved=0, error="UNAVAILABLE: the source went away",
            )  # fmt: skip
            forged = mpb.HeartbeatComputeRequest(instance_id="c1", migration_results=[result])
            assert await refused(stub.HeartbeatCompute, forged) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "migration_results",
            )
            assert (await m.cluster_state()).ledger["s"] == [("a", 2), ("c", 2)]
            assert order.migration_id in m.migrations.in_flight
            await stub.HeartbeatCompute(mpb.HeartbeatComputeRequest(instance_id="c0", migration_results=[result]))
            assert (await m.cluster_state()).ledger["s"] == [("a", 4)] and not m.migrations.in_flight
            assert servers.rmanagers["c"].pool.num_free == 8

    asyncio.run(scenario())


def test_a_compute_instance_keeps_a_growing_sequence_on_the_server_of_its_last_rblock(etcd_server, etcd_prefix):
    """DistAttention over ``ManagerPlacement`` through the served manager: each growth names the server of
    the sequence's last rBlock, so decoding past rBlock boundaries stays on one server while it has room
    (fewer per-layer round trips) instead of following the most free home; then it spills to the next."""
    from infinite_llm.core.dist_attention import DistAttention
    from infinite_llm.services.compute.remote_kv import ManagerPlacement

    async def scenario():
        servers = make_servers({"a": 4, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            await stub.RegisterCompute(
                mpb.RegisterComputeRequest(instance_id="c0", address="127.0.0.1:50070", home_server_ids=["a", "b"])
            )
            placement = ManagerPlacement(stub.address, block_size=4, timeout_s=10.0, instance_id="c0")
            kv = DistAttention(placement, transport=None, block_size=4)  # placement only: no step runs
            assert await asyncio.to_thread(kv.try_allocate, "t", 6)  # b: the most free home
            assert await asyncio.to_thread(kv.try_allocate, "s", 2)  # a: now the most free (4 vs 2)
            for _ in range(4):  # a has 2 more, then the rest spills to b
                assert await asyncio.to_thread(kv.try_allocate, "s", 1)
            assert [ref.holder for ref in kv.block_table("s")] == ["a", "a", "a", "a", "b", "b"]

    asyncio.run(scenario())


def test_a_compute_instance_keeps_its_last_capacity_view_while_no_manager_answers(
    etcd_server, etcd_prefix, monkeypatch
):
    """A manager failover or restart leaves a few seconds without a leader: the instance keeps the last view
    of the cluster's capacity (requests queue for placement, which fails fast meanwhile) instead of failing
    every request that arrives then with UNAVAILABLE (a walkthrough saw 503s for 6 s after a leader's
    SIGKILL). With no view yet there is nothing to go on: Unavailable."""
    from infinite_llm.core.errors import Unavailable
    from infinite_llm.services.compute import remote_kv
    from infinite_llm.services.compute.remote_kv import ManagerPlacement

    monkeypatch.setattr(remote_kv, "CAPACITY_REFRESH_S", 0.0)  # every read asks the manager

    async def scenario():
        servers = make_servers({"a": 4, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            address = stub.address
            placement = ManagerPlacement(address, block_size=4, timeout_s=10.0, instance_id="c0")
            assert await asyncio.to_thread(lambda: (placement.num_total_blocks, placement.num_free_blocks)) == (12, 12)
        # the manager's server is gone
        assert await asyncio.to_thread(lambda: (placement.num_total_blocks, placement.num_free_blocks)) == (12, 12)
        with pytest.raises(Unavailable, match="placement is paused"):
            await asyncio.to_thread(placement.place, "s", 1, 0)
        fresh = ManagerPlacement(address, block_size=4, timeout_s=10.0, instance_id="c1")
        with pytest.raises(Unavailable):
            await asyncio.to_thread(lambda: fresh.num_total_blocks)

    asyncio.run(scenario())


def test_a_waiting_sequence_the_cluster_cannot_hold_asks_placement_once_per_view_not_every_step(
    etcd_server, etcd_prefix
):
    """A waiting head that needs 2 rBlocks where 1 is free: the manager refuses its ``Place``. Until rBlocks
    are freed it is not asked again every step (before, each of ~10 steps a second cost a ``Place`` and a
    capacity read, and a ``MatchPrefix`` with prefix caching on), only after the next read of the cluster's
    capacity (1 s); this instance's own release lets it in at the next step."""
    from infinite_llm.core.dist_attention import DistAttention
    from infinite_llm.core.sampling import SamplingParams
    from infinite_llm.core.scheduler import Scheduler, SchedulerConfig, Sequence
    from infinite_llm.services.compute.remote_kv import CAPACITY_REFRESH_S, ManagerPlacement

    class Counting:
        def __init__(self, stub) -> None:  # noqa: ANN001
            self.stub, self.calls = stub, []

        def __getattr__(self, method: str):  # noqa: ANN204
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.calls.append(method)
                return getattr(self.stub, method)(*args, **kwargs)

            return call

    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, served(m) as stub:
            await stub.RegisterCompute(
                mpb.RegisterComputeRequest(instance_id="c0", address="127.0.0.1:50070", home_server_ids=["a"])
            )
            placement = ManagerPlacement(stub.address, block_size=4, timeout_s=10.0, instance_id="c0")
            placement._manager = counting = Counting(placement._manager)
            kv = DistAttention(placement, transport=None, block_size=4)
            assert await asyncio.to_thread(kv.try_allocate, "r", 3)
            scheduler = Scheduler(SchedulerConfig(), kv)
            waiting = Sequence("w", list(range(1, 9)), SamplingParams(max_tokens=1, temperature=0))
            await asyncio.to_thread(scheduler.add, waiting)  # blocking calls: off the manager's event loop
            counting.calls.clear()
            started = time.monotonic()
            for _ in range(30):  # ~1.5 refresh periods unloaded; slower steps span more views, counted below
                assert not (await asyncio.to_thread(scheduler.schedule)).scheduled
                await asyncio.sleep(0.05)
            views = int((time.monotonic() - started) / CAPACITY_REFRESH_S) + 1  # capacity views the steps saw
            places = counting.calls.count("Place")
            assert 1 <= places <= min(views, 10), counting.calls  # once per view, never once per step (30)
            assert counting.calls.count("GetClusterState") <= views, counting.calls
            await asyncio.to_thread(kv.free, "r")
            (admitted,) = (await asyncio.to_thread(scheduler.schedule)).scheduled
            assert admitted.seq.seq_id == "w" and kv.block_table("w")

    asyncio.run(scenario())


def test_a_second_instance_under_a_live_id_is_refused_and_cannot_heartbeat_for_it(etcd_server, etcd_prefix):
    """Every compute instance shares one certificate. A second process started under a live instance's id
    (another address) is refused while the registered one heartbeats, and its heartbeats, which would list
    only its own sequences (the orphan reconciler would then free the other's), are PERMISSION_DENIED. A
    restart at a new address registers once the old process's heartbeats are two intervals late."""

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 4})) as m, served(m) as stub:
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER))  # c0 at 127.0.0.1:50070
            beat = mpb.HeartbeatComputeRequest(instance_id="c0", address="127.0.0.1:50070", reports_seq_ids=True)
            await stub.HeartbeatCompute(beat)
            other = {**REGISTER, "address": "127.0.0.1:50071"}
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.RegisterCompute(mpb.RegisterComputeRequest(**other))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "is live at 127.0.0.1:50070 (its last heartbeat" in e.value.details()
            assert [r.member_id for r in m.refusals.recent()] == ["c0"]
            for call in (
                stub.HeartbeatCompute(mpb.HeartbeatComputeRequest(instance_id="c0", address="127.0.0.1:50071")),
                stub.DeregisterCompute(mpb.DeregisterComputeRequest(instance_id="c0", address="127.0.0.1:50071")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "registered at 127.0.0.1:50070, not 127.0.0.1:50071" in e.value.details()
            (state,) = await m.compute_instances()
            assert state.info.address == "127.0.0.1:50070"
            # The registered process dies: once its last heartbeat is two intervals old (TTL/3 each), a
            # restart at a new address takes the id over, as before.
            window_s = 2 * m.computes.members.ttl_of("c0") / 3
            load = m.computes._loads["c0"]
            m.computes._loads["c0"] = dataclasses.replace(load, heartbeat_at=load.heartbeat_at - window_s)
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**other))
            (state,) = await m.compute_instances()
            assert state.info.address == "127.0.0.1:50071"

    asyncio.run(scenario())
