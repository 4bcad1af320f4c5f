"""Hot-standby managers (``serve manager --standby``) on a real etcd, with real gRPC clients that dial both.

A standby serves before it leads: ``""`` SERVING (alive), the GlobalManager service NOT_SERVING, and every
GlobalManager call refused with UNAVAILABLE naming the leader. Clients built with ``serving_only()`` over a
target that lists both managers reach the leader, and after the leader goes (its session lease revoked, as
when its process died or was cut off) the same channels reach the standby, which took the lead and loaded
what the old leader had registered."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.options import MANAGER_SERVICE, serving_only
from infinite_llm.services.admin import cluster_state
from infinite_llm.services.manager.records import LEADER_KEY
from infinite_llm.services.manager.server import EXIT_LOST_LEADERSHIP, ManagerServerConfig, serve
from infinite_llm.state.etcd_launcher import free_port
from tests.etcd_server import open_store

from .helpers import LAYOUT, manager_process_config

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_service_name_is_the_managers():
    assert MANAGER_SERVICE == mpb.DESCRIPTOR.services_by_name["GlobalManager"].full_name


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return reply.status


async def _until(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


def _register_request(server_id: str) -> mpb.RegisterRequest:
    return mpb.RegisterRequest(
        server_id=server_id, address=f"{server_id}.local:50060", capacity_blocks=4, block_size=LAYOUT.block_size
    )


def test_clients_follow_the_lead_from_a_lost_leader_to_its_hot_standby(etcd_server, etcd_prefix):
    def config(port: int) -> ManagerServerConfig:  # the member registered through the first leader outlives the test
        return manager_process_config(etcd_server, etcd_prefix, port, member_ttl_s=30, standby=True)

    async def scenario():
        a_port, b_port = free_port(), free_port()
        a = asyncio.create_task(serve(config(a_port)))
        await _until(lambda: _health_is(a_port, MANAGER_SERVICE, SERVING), 30, "the first manager never led")
        b = asyncio.create_task(serve(config(b_port)))
        await _until(lambda: _health_is(b_port, "", SERVING), 30, "the standby never served its health")
        assert await _health(b_port, MANAGER_SERVICE) == NOT_SERVING
        # A standby refuses the manager's calls, naming the leader.
        async with aio_channel(f"127.0.0.1:{b_port}", tls=None) as direct:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await mgrpc.GlobalManagerStub(direct).Register(_register_request("a"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == f"global manager m-{b_port} is standing by; the leader is m-{a_port}"

        # The standby first: gRPC's default pick_first would send every call to it.
        both = f"ipv4:127.0.0.1:{b_port},127.0.0.1:{a_port}"
        async with aio_channel(both, tls=None, extra_options=serving_only()) as channel:
            stub = mgrpc.GlobalManagerStub(channel)
            for _ in range(4):  # round robin without health checks would hit the standby every other call
                await stub.Register(_register_request("a"), timeout=5, wait_for_ready=True)
            state = await asyncio.to_thread(cluster_state, both, 5.0, None)  # the blocking client (status)
            assert [s.server_id for s in state.servers] == ["a"] and state.manager_id == f"m-{a_port}"

            async with open_store(etcd_server, etcd_prefix) as store:
                leader = await store.get(LEADER_KEY)
                assert leader.value == f"m-{a_port}".encode()
                await store.revoke_lease(leader.lease)  # the leader's session lapsed
                assert await asyncio.wait_for(a, 15) == EXIT_LOST_LEADERSHIP
                await _until(lambda: _health_is(b_port, MANAGER_SERVICE, SERVING), 10, "the standby never led")
                assert (await store.get(LEADER_KEY)).value == f"m-{b_port}".encode()

            # The same channels now reach the new leader, which loaded the member the old one registered.
            state = await asyncio.to_thread(cluster_state, both, 5.0, None)
            assert [s.server_id for s in state.servers] == ["a"] and state.manager_id == f"m-{b_port}"
            assert 0 <= state.leading_for_s < 10
            await stub.Register(_register_request("b"), timeout=5, wait_for_ready=True)
            state = await asyncio.to_thread(cluster_state, both, 5.0, None)
            assert sorted(s.server_id for s in state.servers) == ["a", "b"]

        # A standby stopped while standing by exits 0 and leaves the leader alone. serve() handles the signal
        # on this loop; the last serve() started is the one whose handler receives it.
        c_port = free_port()
        c = asyncio.create_task(serve(config(c_port)))
        await _until(lambda: _health_is(c_port, "", SERVING), 30, "the second standby never served its health")
        assert await _health(c_port, MANAGER_SERVICE) == NOT_SERVING
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(c, 15) == 0
        assert not b.done() and await _health(b_port, MANAGER_SERVICE) == SERVING
        # A manager without --standby waiting for the lead (up to its acquire timeout) stops at once too. The
        # signal goes once its handler is installed (after it connected to etcd): before, c's would take it.
        loop, installed = asyncio.get_running_loop(), asyncio.Event()
        add_signal_handler = loop.add_signal_handler

        def add_and_tell(sig, callback, *args):  # noqa: ANN001, ANN002, ANN202
            add_signal_handler(sig, callback, *args)
            if sig == signal.SIGTERM:
                installed.set()

        loop.add_signal_handler = add_and_tell
        try:
            d = asyncio.create_task(
                serve(manager_process_config(etcd_server, etcd_prefix, free_port(), acquire_timeout_s=60))
            )
            await asyncio.wait_for(installed.wait(), 30)
        finally:
            del loop.add_signal_handler
        await asyncio.sleep(0.2)  # campaigning in vain (a signal before that stops it just the same)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(d, 5) == 0
        assert not b.done() and await _health(b_port, MANAGER_SERVICE) == SERVING
        async with open_store(etcd_server, etcd_prefix) as store:
            await store.revoke_lease((await store.get(LEADER_KEY)).lease)
            assert await asyncio.wait_for(b, 15) == EXIT_LOST_LEADERSHIP

    asyncio.run(scenario())


async def _health_is(port: int, service: str, status: int) -> bool:
    try:
        return await _health(port, service) == status
    except grpc.aio.AioRpcError:  # not listening yet, or the name not set yet
        return False
