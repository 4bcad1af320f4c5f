"""The router follows the compute instances the manager lists: real etcd, the manager and the router served
over gRPC on loopback, compute instances registering through the real ComputeRegistrar."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.services.compute.registrar import ComputeLoadReport

from .helpers import ask, cluster, compute_instance


async def until(predicate, timeout_s: float = 10.0) -> float:
    """Await ``predicate()`` (an async callable) becoming true; seconds it took. Fails after ``timeout_s``."""
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def answers(stub, n: int = 4) -> list[str]:
    return [await ask(stub) for _ in range(n)]


def test_router_sends_to_instances_that_join_and_stops_for_those_that_leave(etcd_server, etcd_prefix):
    async def scenario():
        async with cluster(etcd_server, etcd_prefix) as c:
            stub = c.router_stub()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ask(stub)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no compute instance is registered" in e.value.details()
            async with compute_instance(c.manager_address, "c0") as c0:
                await until(lambda: _routed(c, ["c0"]))
                assert await answers(stub) == ["c0"] * 4
                async with compute_instance(c.manager_address, "c1") as c1:
                    await until(lambda: _routed(c, ["c0", "c1"]))
                    # Both idle: turns rotate, so the newcomer takes every other request.
                    assert sorted(await answers(stub)) == ["c0", "c0", "c1", "c1"]
                    served_by_c1 = len(c1.servicer.requests)
                # c1 deregistered on its way out: the router stops sending to it, nothing fails.
                await until(lambda: _routed(c, ["c0"]))
                assert await answers(stub) == ["c0"] * 4
                assert len(c1.servicer.requests) == served_by_c1 == 2
                assert len(c0.servicer.requests) == 4 + 2 + 4

    asyncio.run(scenario())


def test_instance_whose_heartbeats_stop_is_dropped_after_its_lease_even_if_it_still_answers(etcd_server, etcd_prefix):
    async def scenario():
        async with cluster(etcd_server, etcd_prefix, ttl_s=2) as c:
            stub = c.router_stub()
            async with compute_instance(c.manager_address, "c0") as c0, compute_instance(c.manager_address, "c1"):
                await until(lambda: _routed(c, ["c0", "c1"]))
                await c0.registrar.stop(deregister=False)  # hung registration: c0 still serves, its lease lapses
                gone_after_s = await until(lambda: _routed(c, ["c1"]), timeout_s=10)
                assert gone_after_s > 1.0  # the 2 s TTL, not the deregistration, removed it
                assert [i.info.instance_id for i in (await c.manager.compute_instances())] == ["c1"]
                before = len(c0.servicer.requests)
                assert await answers(stub) == ["c1"] * 4
                assert len(c0.servicer.requests) == before

    asyncio.run(scenario())


def test_restarted_instance_registers_again_and_takes_requests_at_its_new_address(etcd_server, etcd_prefix):
    async def scenario():
        async with cluster(etcd_server, etcd_prefix, ttl_s=2) as c:
            stub = c.router_stub()
            async with compute_instance(c.manager_address, "c0") as first:
                old = first.address
                await until(lambda: _routed(c, ["c0"]))
                await first.crash()
                # A crash leaves the lease: the manager still lists c0 at the dead address until it lapses.
                async with compute_instance(c.manager_address, "c0") as second:
                    assert second.address != old
                    await until(lambda: _addresses(c, [second.address]))
                    assert await answers(stub, 2) == ["c0", "c0"]
                    assert len(second.servicer.requests) == 2
                    manager = c.manager_stub()
                    (listed,) = (await manager.ListComputeInstances(mpb.ListComputeInstancesRequest())).instances
                    assert listed.address == second.address

    asyncio.run(scenario())


def test_heartbeats_carry_batch_queue_and_tokens_held(etcd_server, etcd_prefix):
    async def scenario():
        async with cluster(etcd_server, etcd_prefix) as c:
            load = ComputeLoadReport(num_running=3, num_waiting=2, num_tokens_held=170)
            async with compute_instance(c.manager_address, "c0", load, homes=("a",)):
                stub = c.manager_stub()

                async def reported() -> bool:
                    reply = await stub.ListComputeInstances(mpb.ListComputeInstancesRequest(include_debts=True))
                    return [(i.num_running, i.num_waiting, i.num_tokens_held) for i in reply.instances] == [(3, 2, 170)]

                await until(reported)
                (i,) = (await stub.ListComputeInstances(mpb.ListComputeInstancesRequest(include_debts=True))).instances
                assert (i.instance_id, list(i.home_server_ids), i.debt_blocks) == ("c0", ["a"], 0)
                assert 0.0 <= i.heartbeat_age_s < 5.0
                (i,) = (await stub.ListComputeInstances(mpb.ListComputeInstancesRequest())).instances
                assert not i.HasField("debt_blocks")  # not counted unless asked

    asyncio.run(scenario())


def test_static_address_stays_and_is_not_doubled_by_discovery(etcd_server, etcd_prefix):
    async def scenario():
        async with cluster(etcd_server, etcd_prefix) as c:
            async with compute_instance(c.manager_address, "c0") as c0:
                async with cluster(etcd_server, etcd_prefix + "other/", static=(c0.address,)) as s:
                    assert await answers(s.router_stub(), 2) == ["c0", "c0"]  # nobody registered with this manager
                    s.router.set_discovered({c0.address: "c0"})
                    assert [i.address for i in s.router.instances] == [c0.address]

    asyncio.run(scenario())


def test_router_keeps_its_list_while_the_manager_is_unreachable(etcd_server, etcd_prefix):
    async def scenario():
        async with cluster(etcd_server, etcd_prefix) as c:
            async with compute_instance(c.manager_address, "c0"):
                await until(lambda: _routed(c, ["c0"]))
                await c.manager_server.stop(0)
                assert await c.discovery.refresh() is False
                await asyncio.sleep(5 * c.discovery.interval_s)  # the background polls fail too
                assert c.routed() == ["c0"] and await answers(c.router_stub(), 2) == ["c0", "c0"]

    asyncio.run(scenario())


async def _routed(c, ids: list[str]) -> bool:
    return c.routed() == ids


async def _addresses(c, addresses: list[str]) -> bool:
    return sorted(i.address for i in c.router.instances) == addresses
