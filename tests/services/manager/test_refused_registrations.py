"""A member the manager refuses (another KV layout or block size, an id held by another identity) is neither
invisible nor healthy: ``status`` lists it with the reason (``ClusterStateResponse.refused``), it reports
NOT_SERVING on ``grpc.health.v1`` while refused (so Kubernetes readiness fails), and it retries with a growing
pause, joining (SERVING, gone from the list) once the clash is gone. Real etcd, a real GlobalManager service on
loopback, and a real attention server process loop (``serve``) registering with it."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import tensor_pb2 as tpb
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.kv_layout import kv_layout_of
from infinite_llm.services import lease_keeper
from infinite_llm.services.attention.server import AttentionServerConfig, serve
from infinite_llm.services.compute.registrar import ComputeLoadReport, ComputeRegistrar
from infinite_llm.services.manager.refusals import Refusals

from .helpers import LAYOUT, make_servers, running_manager, wait_for
from .test_compute_rpc import REGISTER, served

FP32 = tpb.KVLayout(num_layers=1, block_size=LAYOUT.block_size, num_kv_heads=1, head_dim=2, dtype="float32")
BF16 = tpb.KVLayout(num_layers=1, block_size=LAYOUT.block_size, num_kv_heads=1, head_dim=2, dtype="bfloat16")


def test_refusals_count_attempts_lapse_after_the_ttl_and_are_bounded():
    now = [100.0]
    r = Refusals(ttl_s=10.0, max_entries=2, clock=lambda: now[0])
    r.note("attention", "b", "10.0.0.2:1", "other layout")
    now[0] = 105.0
    r.note("attention", "b", "10.0.0.3:1", "other block size")
    [b] = r.recent()
    assert (b.address, b.reason, b.times, b.first_at, b.last_at) == ("10.0.0.3:1", "other block size", 2, 100.0, 105.0)
    now[0] = 114.9
    assert [x.member_id for x in r.recent()] == ["b"]  # 9.9 s after its last attempt
    now[0] = 115.0
    assert r.recent() == []
    for member in ("c", "d", "e"):
        r.note("compute", member, "", "clash")
    assert [x.member_id for x in r.recent()] == ["d", "e"]  # the stalest went first
    r.forget("compute", "d")
    assert [x.member_id for x in r.recent()] == ["e"]


def test_refused_registrations_are_listed_with_their_reason_until_the_member_registers(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False) as m, served(m) as stub:
            register = dict(address="127.0.0.1:50061", capacity_blocks=4, block_size=LAYOUT.block_size)
            await stub.Register(mpb.RegisterRequest(server_id="a", layout=FP32, **register))
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Register(
                        mpb.RegisterRequest(server_id="b", layout=BF16, **{**register, "address": "127.0.0.1:50062"})
                    )
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Register(mpb.RegisterRequest(server_id="c", **{**register, "block_size": 8}))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER, layout=BF16))
            state = await stub.GetClusterState(mpb.ClusterStateRequest())
            assert [s.server_id for s in state.servers] == ["a"]
            listed = {(r.kind, r.member_id): r for r in state.refused}
            assert sorted(listed) == [("attention", "b"), ("attention", "c"), ("compute", "c0")]
            b = listed["attention", "b"]
            assert (b.address, b.attempts) == ("127.0.0.1:50062", 2)
            assert b.reason.startswith("attention server 'b' keeps KV as bfloat16")
            assert "attention server a" in b.reason
            assert 0 <= b.last_refused_ago_s <= b.first_refused_ago_s < 10
            assert listed["attention", "c"].reason.endswith("this cluster's block_size is 4")
            assert listed["attention", "c"].attempts == 1
            counter = stub.servicer.metrics.registrations_refused
            totals = {
                s.labels["kind"]: s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")
            }
            assert totals == {"attention": 3, "compute": 1}  # the manager's registrations_refused_total{kind}

            await stub.Deregister(mpb.DeregisterRequest(server_id="a"))  # the clash leaves: b and c0 may join
            await stub.Register(
                mpb.RegisterRequest(server_id="b", layout=BF16, **{**register, "address": "127.0.0.1:50062"})
            )
            await stub.RegisterCompute(mpb.RegisterComputeRequest(**REGISTER, layout=BF16))
            state = await stub.GetClusterState(mpb.ClusterStateRequest())
            assert [(r.kind, r.member_id) for r in state.refused] == [("attention", "c")]
            assert [s.server_id for s in state.servers] == ["b"]

    asyncio.run(scenario())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attention_config(manager_address: str, port: int, drain_timeout_s: float) -> AttentionServerConfig:
    """An fp32 attention server "s" of the tests' layout on ``port``, registering with ``manager_address``."""
    return AttentionServerConfig(
        server_id="s", kv_memory_bytes=1 << 16, num_layers=1, num_kv_heads=1, head_dim=2,
        block_size=LAYOUT.block_size, port=port, grace_s=0, manager_address=manager_address,
        drain_timeout_s=drain_timeout_s,
    )  # fmt: skip


async def _health(address: str) -> int:
    channel = aio_channel(address)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status
    finally:
        await channel.close()


def test_a_refused_attention_server_is_not_serving_and_joins_once_the_clash_is_gone(
    etcd_server, etcd_prefix, monkeypatch
):
    monkeypatch.setattr(lease_keeper, "RETRY_S", 0.2)  # the first pause after a refusal; it doubles
    monkeypatch.setattr(lease_keeper, "REFUSED_RETRY_MAX_S", 0.4)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({}), register=False) as m, served(m) as stub:
            # "a" keeps bf16 KV of the same shape: the server below (fp32) clashes with it
            await m.register("a", "127.0.0.1:50061", 4, LAYOUT.block_size, kv_layout=kv_layout_of(BF16))
            port = _free_port()
            stop = asyncio.Event()
            task = asyncio.create_task(serve(_attention_config(stub.address, port, drain_timeout_s=0), stop))
            try:
                refused_now = []

                async def listed() -> bool:
                    state = await stub.GetClusterState(mpb.ClusterStateRequest())
                    refused_now[:] = [(r.member_id, r.attempts) for r in state.refused]
                    return bool(refused_now) and refused_now[0][1] >= 2

                deadline = asyncio.get_running_loop().time() + 10
                while not await listed():  # refused twice: the server keeps trying
                    assert asyncio.get_running_loop().time() < deadline, f"not refused twice: {refused_now}"
                    await asyncio.sleep(0.05)
                assert await _health(f"127.0.0.1:{port}") == not_serving
                assert "s" not in [x.info.server_id for x in m.members()]

                await m.deregister("a")
                await wait_for(lambda: "s" in [x.info.server_id for x in m.members()], 5)
                await wait_for(lambda: m.refusals.recent() == [], 1)
                deadline = asyncio.get_running_loop().time() + 5
                while await _health(f"127.0.0.1:{port}") != serving:
                    assert asyncio.get_running_loop().time() < deadline, "still NOT_SERVING after it registered"
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)

    asyncio.run(scenario())


def test_a_compute_instance_is_told_when_it_is_refused_and_when_it_is_admitted(etcd_server, etcd_prefix, monkeypatch):
    """The compute instance's registrar reports the manager's reason once, then ``None`` when it joins (its
    server then reports NOT_SERVING, then SERVING, as the attention server above)."""
    monkeypatch.setattr(lease_keeper, "RETRY_S", 0.1)
    monkeypatch.setattr(lease_keeper, "REFUSED_RETRY_MAX_S", 0.2)

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({}), register=False) as m, served(m) as stub:
            await m.register("a", "127.0.0.1:50061", 4, LAYOUT.block_size, kv_layout=kv_layout_of(FP32))
            told: list[str | None] = []

            async def on_refused(reason: str | None) -> None:
                told.append(reason)

            def load() -> ComputeLoadReport:
                return ComputeLoadReport(0, 0, 0)

            registrar = ComputeRegistrar(
                stub.address, "c0", "127.0.0.1:50070", load, layout=BF16, on_refused=on_refused
            )
            registrar.start()
            try:
                await wait_for(lambda: len(m.refusals.recent()) == 1 and m.refusals.recent()[0].times >= 3, 10)
                assert len(told) == 1 and told[0].startswith("compute instance 'c0' needs KV as bfloat16")
                assert not registrar.registered.is_set()
                await m.deregister("a")
                await asyncio.wait_for(registrar.registered.wait(), 5)
                assert told[1:] == [None]
                assert m.refusals.recent() == []
            finally:
                await registrar.stop()

    asyncio.run(scenario())


def test_heartbeats_and_deregistration_from_another_address_than_the_registrations_are_refused(
    etcd_server, etcd_prefix
):
    """Every attention server shares one certificate: a second process under a live id (refused at Register)
    must not drain or remove the live server. Heartbeat and Deregister naming another address are
    PERMISSION_DENIED; an older server that names none is not checked."""

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({}), register=False) as m, served(m) as stub:
            await stub.Register(mpb.RegisterRequest(server_id="a", address="127.0.0.1:50061", capacity_blocks=4,
                                                    block_size=LAYOUT.block_size))  # fmt: skip
            for call in (
                stub.Heartbeat(
                    mpb.HeartbeatRequest(server_id="a", free_blocks=4, draining=True, address="127.0.0.1:9")
                ),
                stub.Deregister(mpb.DeregisterRequest(server_id="a", address="127.0.0.1:9")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "registered at 127.0.0.1:50061, not 127.0.0.1:9" in e.value.details()
            assert [x.info.server_id for x in m.members()] == ["a"] and m.drains.draining == frozenset()
            await stub.Heartbeat(mpb.HeartbeatRequest(server_id="a", free_blocks=4))  # an older server: no address
            await stub.Heartbeat(mpb.HeartbeatRequest(server_id="a", free_blocks=4, address="127.0.0.1:50061"))
            await stub.Deregister(mpb.DeregisterRequest(server_id="a", address="127.0.0.1:50061"))
            assert m.members() == []

    asyncio.run(scenario())


def test_a_refused_duplicate_attention_server_that_stops_leaves_the_live_one_registered(
    etcd_server, etcd_prefix, monkeypatch
):
    """A second `serve attention` under a live server's id: refused (PERMISSION_DENIED, NOT_SERVING); when it
    stops (SIGTERM's path: drain, deregister) the live server stays registered and is not draining (a
    walkthrough saw the duplicate's stop drain and remove the live one)."""
    monkeypatch.setattr(lease_keeper, "RETRY_S", 0.1)

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({}), register=False) as m, served(m) as stub:
            await m.register("s", "127.0.0.1:50061", 4, LAYOUT.block_size, kv_layout="")  # the live server "s"
            stop = asyncio.Event()
            task = asyncio.create_task(serve(_attention_config(stub.address, _free_port(), drain_timeout_s=5), stop))
            try:
                await wait_for(lambda: any(r.member_id == "s" for r in m.refusals.recent()), 10)
                assert "registered from another identity or address" in m.refusals.recent()[0].reason
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)
            assert [(x.info.server_id, x.info.address) for x in m.members()] == [("s", "127.0.0.1:50061")]
            assert m.drains.draining == frozenset()

    asyncio.run(scenario())
