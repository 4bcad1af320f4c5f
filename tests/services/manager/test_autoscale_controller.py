"""The autoscaler against a real global manager (real etcd, real rManagers as attention servers) and a fake
StatefulSet: draining keeps placement off a server, scale-down waits for the drain, followers never scale."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest
from typer.testing import CliRunner

from infinite_llm.core.errors import CapacityExhausted, Unavailable
from infinite_llm.services.manager import Grant
from infinite_llm.services.manager.autoscale import (
    Action,
    Autoscaler,
    AutoscaleSettings,
    Decision,
    DrainGuard,
    ScalingConfig,
)
from infinite_llm.services.manager.autoscale.controller import draining_servers, observe, ordinal_of
from infinite_llm.services.manager.autoscale.policy import PoolObservation, ServerLoad
from infinite_llm.services.manager.records import ClusterState, MemberInfo, MemberState

from .helpers import LAYOUT, make_servers, running_manager, wait_for

# Decide at once (no windows) so each tick shows the rule it applies; the cool-down is on a manual clock.
IMMEDIATE = ScalingConfig(
    min_replicas=1,
    max_replicas=4,
    scale_up_below=0.10,
    scale_down_above=0.60,
    scale_up_after_s=0,
    scale_down_after_s=0,
    cooldown_s=100,
)


class FakeStatefulSet:
    """The scale subresource of one StatefulSet; ``fail`` makes every call raise like an API outage."""

    def __init__(self, replicas: int) -> None:
        self.replicas, self.fail, self.patches, self.reads = replicas, False, [], 0

    def get_replicas(self) -> int:
        self.reads += 1
        if self.fail:
            raise Unavailable("Kubernetes API call read_namespaced_stateful_set_scale failed: HTTP 503")
        return self.replicas

    def set_replicas(self, replicas: int) -> None:
        if self.fail:
            raise Unavailable("Kubernetes API call patch_namespaced_stateful_set_scale failed: HTTP 503")
        self.patches.append(replicas)
        self.replicas = replicas


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def register_all(manager, servers) -> None:
    for sid, rm in servers.rmanagers.items():
        await manager.register(sid, f"{sid}.attention.ns.svc:50060", rm.pool.num_blocks, LAYOUT.block_size)


def pool_of(n: int, blocks: int = 8):
    servers = make_servers({f"attention-{i}": blocks for i in range(n)})
    return servers, DrainGuard(servers)


def test_drained_server_gets_no_new_rblocks_and_goes_only_once_empty(etcd_server, etcd_prefix):
    async def scenario():
        servers, guard = pool_of(3)
        sts, clock = FakeStatefulSet(3), Clock()
        async with running_manager(etcd_server, etcd_prefix, guard, register=False) as m:
            await register_all(m, servers)
            autoscaler = Autoscaler(m, guard, sts, AutoscaleSettings("attention", policy=IMMEDIATE), clock)
            assert await m.place("s1", 4, near="attention-2") == [Grant("attention-2", 4, (0, 1, 2, 3))]
            # 20 of 24 free (83%); without attention-2 16 of 16: drain it.
            d = await autoscaler.tick()
            assert (d.action, d.replicas, d.ordinal) == (Action.DRAIN, 3, 2)
            assert guard.draining == {"attention-2"} and sts.patches == []
            # Even asked for by name, new rBlocks go elsewhere; nothing is left reserved on attention-2.
            assert await m.place("s2", 2, near="attention-2") == [Grant("attention-0", 2, (0, 1))]
            assert servers.rmanagers["attention-2"].pool.num_reserved == 0
            clock.now = 500
            d = await autoscaler.tick()
            assert (d.action, d.reason) == (Action.HOLD, "draining server 2: 4 rBlocks left")
            assert sts.replicas == 3
            assert await m.release("s1") == 4
            d = await autoscaler.tick()
            assert (d.action, d.replicas, d.ordinal) == (Action.SCALE_DOWN, 2, 2)
            assert sts.patches == [2]
            # Until its pod is gone (its lease lapses) it stays off limits.
            assert guard.draining == {"attention-2"}
            await m.deregister("attention-2")
            clock.now = 550
            d = await autoscaler.tick()
            assert (d.action, d.reason) == (Action.HOLD, "cooling down for 50 s")
            assert guard.draining == frozenset()

    asyncio.run(scenario())


def test_pool_grows_when_free_rblocks_run_low(etcd_server, etcd_prefix):
    async def scenario():
        servers, guard = pool_of(3)
        sts, clock = FakeStatefulSet(3), Clock()
        async with running_manager(etcd_server, etcd_prefix, guard, register=False) as m:
            await register_all(m, servers)
            settings = AutoscaleSettings("attention", policy=dataclasses.replace(IMMEDIATE, max_replicas=5))
            autoscaler = Autoscaler(m, guard, sts, settings, clock)
            await m.place("long-context", 22)
            with pytest.raises(CapacityExhausted):
                await m.place("another", 3)
            d = await autoscaler.tick()
            assert (d.action, d.replicas, d.reason) == (Action.SCALE_UP, 4, "8% free for 0 s")
            assert sts.patches == [4]
            clock.now = 200  # past the cool-down, the new pod has not registered yet
            d = await autoscaler.tick()
            assert (d.action, d.reason) == (Action.HOLD, "waiting for servers [3] to register")
            servers.rmanagers["attention-3"] = make_servers({"attention-3": 8}).rmanagers["attention-3"]
            await m.register("attention-3", "attention-3.attention.ns.svc:50060", 8, LAYOUT.block_size)
            assert await m.place("another", 3) == [Grant("attention-3", 3, (0, 1, 2))]
            d = await autoscaler.tick()
            assert (d.action, d.reason) == (Action.HOLD, "22% free")
            assert sts.patches == [4]

    asyncio.run(scenario())


def test_a_failed_kubernetes_call_is_retried_on_the_next_tick(etcd_server, etcd_prefix):
    async def scenario():
        servers, guard = pool_of(2)
        sts = FakeStatefulSet(2)
        async with running_manager(etcd_server, etcd_prefix, guard, register=False) as m:
            await register_all(m, servers)
            autoscaler = Autoscaler(m, guard, sts, AutoscaleSettings("attention", policy=IMMEDIATE), Clock())
            await m.place("s", 16)
            sts.fail = True
            with pytest.raises(Unavailable, match="HTTP 503"):
                await autoscaler.tick()
            sts.fail = False
            d = await autoscaler.tick()
            assert (d.action, d.replicas) == (Action.SCALE_UP, 3) and sts.patches == [3]

    asyncio.run(scenario())


def test_a_follower_never_scales(etcd_server, etcd_prefix):
    async def scenario():
        servers, guard = pool_of(1)
        async with running_manager(etcd_server, etcd_prefix, guard, register=False) as leader:
            await register_all(leader, servers)
            await leader.place("s", 8)
            async with running_manager(
                etcd_server, etcd_prefix, guard, manager_id="m2", register=False, lead=False
            ) as follower:
                assert not follower.is_leader
                sts = FakeStatefulSet(1)
                autoscaler = Autoscaler(follower, guard, sts, AutoscaleSettings("attention", policy=IMMEDIATE))
                assert await autoscaler.tick() is None
                assert (sts.reads, sts.patches) == (0, [])

    asyncio.run(scenario())


def test_the_loop_keeps_going_through_errors(etcd_server, etcd_prefix):
    async def scenario():
        servers, guard = pool_of(1)
        sts = FakeStatefulSet(1)
        async with running_manager(etcd_server, etcd_prefix, guard, register=False) as m:
            await register_all(m, servers)
            await m.place("s", 8)
            sts.fail = True
            settings = AutoscaleSettings("attention", policy=IMMEDIATE, interval_s=0.05)
            autoscaler = Autoscaler(m, guard, sts, settings)
            autoscaler.start()
            await wait_for(lambda: sts.reads >= 3, timeout_s=10)  # polled: a loaded machine ticks late
            assert sts.patches == []
            sts.fail = False
            await wait_for(lambda: sts.patches != [], timeout_s=10)
            await autoscaler.stop()
            assert sts.patches == [2]

    asyncio.run(scenario())


def test_a_placement_finishing_while_the_ledger_is_read_keeps_the_server():
    """The in-flight count is taken before the ledger is read: a reservation committed in between (its ledger
    entry written after that read) still counts, so the server is not removed with rBlocks on it."""

    async def scenario():
        servers, guard = pool_of(2)
        reservation = await guard.reserve("attention-1", "s", 2)

        class Manager:
            is_leader = True

            async def cluster_state(self):
                members = [
                    MemberState(MemberInfo(f"attention-{i}", "x:1", 8, 16), free, 0.0, False)
                    for i, free in ((0, 8), (1, 6))
                ]
                state = ClusterState("m1", members, {})  # the ledger as read: before the placement's write
                await guard.commit("attention-1", reservation.reservation_id, [0, 1])  # ... which lands meanwhile
                return state

        sts = FakeStatefulSet(2)
        autoscaler = Autoscaler(Manager(), guard, sts, AutoscaleSettings("attention", policy=IMMEDIATE), Clock())
        autoscaler.policy.commit(Decision(Action.DRAIN, 2, 1), 0)  # server 1 is being drained
        d = await autoscaler.tick()
        assert (d.action, d.reason) == (Action.HOLD, "draining server 1: 1 rBlocks left")
        assert sts.patches == [] and guard.in_flight("attention-1") == 0

    asyncio.run(scenario())


# ---- pieces ------------------------------------------------------------------------------------------
def test_server_ids_are_pod_names_of_the_statefulset():
    assert [
        ordinal_of(s, "attention")
        for s in ("attention-0", "attention-12", "attention-x", "attention-01", "attn-0", "attention-", "attention-2-1")
    ] == [0, 12, None, None, None, None, None]


def test_observe_counts_ledger_and_reservations_in_flight_per_ordinal():
    def member(sid: str, free: int, kind: str = "attention") -> MemberState:
        return MemberState(MemberInfo(sid, f"{sid}:1", 10, 16, kind), free, 0.0, False)

    state = ClusterState(
        "m1",
        [
            member("attention-0", 6),
            member("attention-1", 10),
            member("other-0", 1),
            member("attention-2", 3, kind="cache"),
        ],
        {"a": [("attention-0", 3), ("attention-1", 0)], "b": [("attention-0", 1)]},
    )
    obs = observe(state, 3, "attention", in_flight=lambda sid: {"attention-1": 2}.get(sid, 0))
    assert obs == PoolObservation(3, {0: ServerLoad(10, 6, 4), 1: ServerLoad(10, 10, 2)})


def test_servers_being_removed_stay_off_limits():
    members = ["attention-0", "attention-1", "attention-2", "attention-3", "other-9"]
    assert draining_servers("attention", None, 4, members) == frozenset()
    assert draining_servers("attention", 3, 4, members) == {"attention-3"}
    assert draining_servers("attention", None, 2, members) == {"attention-2", "attention-3"}


def test_drain_guard_refuses_draining_servers_and_counts_reservations_in_flight():
    async def scenario():
        servers = make_servers({"attention-0": 4, "attention-1": 4})
        guard = DrainGuard(servers)
        guard.set_draining(frozenset({"attention-1"}))
        with pytest.raises(CapacityExhausted, match="'attention-1' is draining"):
            await guard.reserve("attention-1", "s", 1)
        assert servers.rmanagers["attention-1"].pool.num_reserved == 0
        r = await guard.reserve("attention-0", "s", 2)
        assert guard.in_flight("attention-0") == 1
        assert await guard.commit("attention-0", r.reservation_id, [0, 1]) == [0, 1]
        assert guard.in_flight("attention-0") == 0
        r = await guard.reserve("attention-0", "t", 1)
        await guard.cancel("attention-0", r.reservation_id)
        assert guard.in_flight("attention-0") == 0
        with pytest.raises(CapacityExhausted):
            await guard.reserve("attention-0", "u", 5)  # more than it has: counted back at once
        assert guard.in_flight("attention-0") == 0
        assert await guard.free("attention-0", "s") == 2

    asyncio.run(scenario())


def test_reservation_awaited_when_the_drain_starts_is_in_flight():
    async def scenario():
        servers = make_servers({"attention-0": 4})
        gate = asyncio.Event()

        class Slow:
            async def reserve(self, *args):
                await gate.wait()
                return await servers.reserve(*args)

        guard = DrainGuard(Slow())
        task = asyncio.create_task(guard.reserve("attention-0", "s", 1))
        await asyncio.sleep(0)
        guard.set_draining(frozenset({"attention-0"}))
        assert guard.in_flight("attention-0") == 1
        gate.set()
        await task
        assert guard.in_flight("attention-0") == 1  # reserved, not yet committed: not drained

    asyncio.run(scenario())


# ---- the command line ----------------------------------------------------------------------------------
def test_serve_manager_flags_build_the_autoscaler_settings(monkeypatch):
    from infinite_llm.cli import app
    from infinite_llm.services.manager import server

    seen = []

    async def fake_serve(config):
        seen.append(config)

    monkeypatch.setattr(server, "serve", fake_serve)
    result = CliRunner().invoke(
        app,
        [
            "serve",
            "manager",
            "--etcd",
            "etcd-client:2379",
            "--k8s-statefulset",
            "attention",
            "--k8s-namespace",
            "llm",
            "--min-replicas",
            "2",
            "--max-replicas",
            "6",
            "--scale-up-below",
            "0.2",
            "--scale-down-above",
            "0.7",
            "--scale-up-after",
            "15",
            "--scale-down-after",
            "120",
            "--scale-cooldown",
            "60",
            "--autoscale-interval",
            "2",
            "--insecure",  # the flags under test, not certificates
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen[0].autoscale == AutoscaleSettings("attention", "llm", ScalingConfig(2, 6, 0.2, 0.7, 15, 120, 60), 2)
    seen.clear()
    assert CliRunner().invoke(app, ["serve", "manager", "--insecure"]).exit_code == 0
    assert seen[0].autoscale is None  # no flag: the manager never touches Kubernetes


@pytest.mark.parametrize(
    "args,message",
    [
        (["--min-replicas", "3", "--max-replicas", "2"], "max_replicas (2) must be >= min_replicas (3)"),
        (["--scale-up-below", "0.7"], "0 <= scale_up_below < scale_down_above <= 1"),
        (["--autoscale-interval", "0"], "interval_s must be > 0, got 0.0"),
    ],
)
def test_serve_manager_refuses_bad_autoscaler_flags(args, message):
    from infinite_llm.cli import app

    result = CliRunner().invoke(app, ["serve", "manager", "--k8s-statefulset", "attention", *args])
    assert result.exit_code == 2

    def squash(text: str) -> str:  # the message is wrapped inside a box
        return re.sub(r"[\s│╭╮╰╯─]", "", text)

    assert squash(message) in squash(result.output)


def test_serve_manager_outside_kubernetes_fails_fast_with_a_clear_message(monkeypatch):
    from infinite_llm.services.manager.server import ManagerServerConfig, serve

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = ManagerServerConfig(etcd="127.0.0.1:1", autoscale=AutoscaleSettings("attention"))
    with pytest.raises(Unavailable, match="scaling StatefulSet 'attention' needs the in-cluster Kubernetes config"):
        asyncio.run(serve(config))  # before connecting to etcd (nothing listens on port 1)


def test_serve_manager_scales_the_statefulset_when_its_pool_fills(etcd_server, etcd_prefix, monkeypatch):
    """The process path: ``serve()`` with autoscaling, a real attention server registering over gRPC, a
    placement through the GlobalManager service that fills it, the StatefulSet patched, SIGTERM stops all."""
    import os
    import signal

    from infinite_llm.pb.v1 import manager_pb2 as mpb
    from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
    from infinite_llm.rpc.channels import aio_channel
    from infinite_llm.services.attention.registrar import Registrar
    from infinite_llm.services.attention.server import AttentionServerConfig, start
    from infinite_llm.services.manager.autoscale import KubernetesScaler
    from infinite_llm.services.manager.server import ManagerServerConfig, serve
    from infinite_llm.state.etcd_launcher import free_port

    sts = FakeStatefulSet(1)
    monkeypatch.setattr(KubernetesScaler, "in_cluster", classmethod(lambda cls, name, namespace="": sts))
    port = free_port()
    policy = ScalingConfig(min_replicas=1, max_replicas=3, scale_up_after_s=0, scale_down_after_s=600, cooldown_s=600)
    config = ManagerServerConfig(
        etcd=f"{etcd_server.host}:{etcd_server.client_port}",
        port=port,
        prefix=etcd_prefix,
        member_ttl_s=3,
        block_size=LAYOUT.block_size,
        autoscale=AutoscaleSettings("attention", "llm", policy, interval_s=0.1),
    )

    async def scenario():
        manager = asyncio.create_task(serve(config))
        server = await start(
            AttentionServerConfig(
                server_id="attention-0",
                kv_memory_bytes=8 * LAYOUT.bytes_per_block,
                num_layers=LAYOUT.num_layers,
                num_kv_heads=LAYOUT.num_kv_heads,
                head_dim=LAYOUT.head_dim,
                block_size=LAYOUT.block_size,
            )
        )
        registrar = Registrar(
            f"127.0.0.1:{port}", "attention-0", server.address, LAYOUT.block_size, server.servicer.holder.stats
        )
        registrar.start()
        try:
            await asyncio.wait_for(registrar.registered.wait(), 30)
            stub = mgrpc.GlobalManagerStub(aio_channel(f"127.0.0.1:{port}"))
            reply = await stub.Place(mpb.PlaceRequest(seq_id="long", num_blocks=8))
            assert [(g.server_id, list(g.block_ids)) for g in reply.grants] == [("attention-0", list(range(8)))]
            for _ in range(100):
                if sts.patches:
                    break
                await asyncio.sleep(0.05)
            assert sts.patches == [2]
        finally:
            await registrar.stop()
            await server.stop(0)
            if sts.patches and not manager.done():
                # The autoscaler ticked, so serve() had installed its handler: a graceful stop of all.
                os.kill(os.getpid(), signal.SIGTERM)
            elif not manager.done():  # the test failed early: no signal to a process without the handler
                manager.cancel()
            await asyncio.wait_for(manager, 30)
        assert sts.patches == [2]

    asyncio.run(scenario())
