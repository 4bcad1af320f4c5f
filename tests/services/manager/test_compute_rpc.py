"""The compute-instance RPCs of the GlobalManager service on loopback over real etcd: status codes for bad
input, unknown and expired instances, and followers; the cluster state as operators read it."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.errors import error_from_rpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.manager.servicer import GlobalManagerServicer

from .helpers import make_servers, running_manager


@contextlib.asynccontextmanager
async def served(manager):
    """``manager`` behind a GlobalManager gRPC server on a free loopback port; yields a stub."""
    servicer = GlobalManagerServicer(manager)
    service = Service.of(mpb, "GlobalManager", mgrpc.add_GlobalManagerServicer_to_server, servicer)
    server = await start_server([service], "127.0.0.1:0")
    channel = aio_channel(f"127.0.0.1:{server.port}")
    try:
        yield mgrpc.GlobalManagerStub(channel)
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
