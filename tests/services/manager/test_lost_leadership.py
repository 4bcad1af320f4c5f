"""A manager process that loses leadership exits (status 1) instead of staying up as a follower that answers
every call UNAVAILABLE forever, and a fresh process on the same etcd leads and serves at once. The session
lease is revoked in a real etcd, as when the process was paused or cut off from etcd past its TTL."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.services.manager.records import LEADER_KEY
from infinite_llm.services.manager.server import EXIT_LOST_LEADERSHIP, ManagerServerConfig, serve
from infinite_llm.state.etcd_launcher import free_port
from tests.etcd_server import open_store

from .helpers import LAYOUT, manager_process_config


async def _register(address: str) -> grpc.StatusCode:
    channel = aio_channel(address)
    try:
        request = mpb.RegisterRequest(
            server_id="a", address="a.local:50060", capacity_blocks=4, block_size=LAYOUT.block_size
        )
        await mgrpc.GlobalManagerStub(channel).Register(request, timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await channel.close()


async def _until_serving(address: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while await _register(address) != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the manager never served"
        await asyncio.sleep(0.2)


def test_a_manager_that_loses_leadership_exits_and_a_fresh_one_leads(etcd_server, etcd_prefix):
    def config(port: int) -> ManagerServerConfig:
        return manager_process_config(etcd_server, etcd_prefix, port, acquire_timeout_s=10)

    async def scenario():
        first_port = free_port()
        first = asyncio.create_task(serve(config(first_port)))
        await _until_serving(f"127.0.0.1:{first_port}")
        async with open_store(etcd_server, etcd_prefix) as store:
            leader = await store.get(LEADER_KEY)
            assert leader is not None and leader.value == f"m-{first_port}".encode()
            await store.revoke_lease(leader.lease)  # the session lapsed (the key goes with it)
            # the keep-alive notices at its next refresh (every leader_ttl_s / 3)
            assert await asyncio.wait_for(first, 15) == EXIT_LOST_LEADERSHIP
            second_port = free_port()
            second = asyncio.create_task(serve(config(second_port)))
            await _until_serving(f"127.0.0.1:{second_port}", timeout_s=15)
            assert (await store.get(LEADER_KEY)).value == f"m-{second_port}".encode()
            os.kill(os.getpid(), signal.SIGTERM)  # serve() handles it on this loop: a graceful stop
            assert await asyncio.wait_for(second, 15) == 0
            assert await store.get(LEADER_KEY) is None  # it resigned

    asyncio.run(scenario())
