"""The router retries a request on another compute instance when the first fails before its first token
(under a fresh downstream id; the caller sees its own), fails it with UNAVAILABLE after one, and refuses a
request id already in flight. Real gRPC servers on loopback, model-free compute instances."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from infinite_llm.client.errors import KVMemoryLost, error_from_rpc
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.router.servicer import RouterServicer


class Compute(cgrpc.ComputeInstanceServicer):
    """``mode``: "ok" answers two messages; "dead" fails UNAVAILABLE at once; "dies" after one message;
    "slow" answers once ``release`` is set; "lost" fails with ``KVMemoryLost`` at once. Remembers the request ids
    it was sent."""

    def __init__(self, mode: str) -> None:
        self.mode, self.ids = mode, []
        self.release = asyncio.Event()

    async def Generate(self, request: gpb.GenerateRequest, context):  # noqa: N802, ANN001
        self.ids.append(request.request_id)
        if self.mode == "dead":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "compute instance gone")
        if self.mode == "lost":
            raise KVMemoryLost("the KV memory shrank to 4 rBlocks")
        if self.mode == "slow":
            await asyncio.wait_for(self.release.wait(), 10)
        yield gpb.GenerateResponse(request_id=request.request_id, token_ids=[1], text="a")
        if self.mode == "dies":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "compute instance gone")
        yield gpb.GenerateResponse(request_id=request.request_id, token_ids=[2], text="b", finish_reason="length")


async def _serve(servicer):
    service = Service.of(cpb, "ComputeInstance", cgrpc.add_ComputeInstanceServicer_to_server, servicer)
    return await start_server([service], "127.0.0.1:0")


@contextlib.asynccontextmanager
async def _mesh(*modes: str):
    """``(computes, servers, stub)``: a compute instance of each mode and a router over them, stopped after."""
    computes = [Compute(m) for m in modes]
    servers = [await _serve(c) for c in computes]
    router = RouterServicer([f"127.0.0.1:{s.port}" for s in servers], "tiny", 2048, tokenizer=None)
    rserver = await start_server([Service.of(rpb, "Router", rgrpc.add_RouterServicer_to_server, router)], "127.0.0.1:0")
    stub = rgrpc.RouterStub(aio_channel(f"127.0.0.1:{rserver.port}"))
    try:
        yield computes, [*servers, rserver], stub
    finally:
        for s in [*servers, rserver]:
            await s.stop(0)


def _request(rid: str) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(request_id=rid, text="hi", sampling=gpb.SamplingParams(max_tokens=2))


def test_a_request_refused_before_its_first_token_is_retried_elsewhere_under_a_fresh_id():
    async def scenario():
        async with _mesh("dead", "ok") as ((dead, ok), _, stub):
            rids = ["req-a", "req-b", "req-c"]
            for rid in rids:
                reply = await stub.Generate(_request(rid), timeout=10)
                assert (reply.request_id, list(reply.token_ids), reply.finish_reason) == (rid, [1, 2], "length")
            assert dead.ids  # turns rotate: some went to the dead instance first
            assert len(ok.ids) == len(rids) and len(set(ok.ids)) == len(rids)
            for rid, seen in zip(rids, ok.ids, strict=True):  # each answered once, by ok
                if rid in dead.ids:
                    assert seen.startswith(rid + ":retry-") and len(seen) == len(rid) + 19
                else:
                    assert seen == rid

    asyncio.run(scenario())


def test_when_every_instance_refuses_the_caller_is_told_what_the_last_one_answered():
    async def scenario():
        async with _mesh("dead", "dead") as (computes, servers, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_request("req-x"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            last = next(s.port for c, s in zip(computes, servers, strict=False) if c.ids and c.ids[0] != "req-x")
            assert info.value.details() == (
                f"no compute instance could take the request (tried 2); the last one tried (127.0.0.1:{last}) "
                "answered: compute instance gone"
            )
            assert sorted(len(c.ids) for c in computes) == [1, 1]

    asyncio.run(scenario())


def test_an_instance_that_dies_after_the_first_token_fails_the_stream_with_unavailable():
    async def scenario():
        async with _mesh("dies") as ((dies,), _, stub):
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for msg in stub.GenerateStream(_request("req-c"), timeout=10):
                    got.append((msg.request_id, list(msg.token_ids)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert got == [("req-c", [1])] and dies.ids == ["req-c"]  # not retried: a token was sent

    asyncio.run(scenario())


def test_a_request_id_already_in_flight_is_refused():
    async def scenario():
        async with _mesh("slow") as ((slow,), _, stub):
            first = asyncio.ensure_future(stub.Generate(_request("req-d"), timeout=10))
            for _ in range(500):  # until the compute instance has it: the router holds the id
                if slow.ids:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_request("req-d"), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            slow.release.set()
            assert (await first).finish_reason == "length" and slow.ids == ["req-d"]

    asyncio.run(scenario())


def test_kv_memory_lost_is_not_retried_on_another_instance():
    """Every compute instance places in the same KV memory: one whose sequence the shrunken memory cannot hold
    any more answers ``KVMemoryLost``, which the caller gets as is (RESOURCE_EXHAUSTED, its reason and
    message) instead of the request being sent to the next instance."""

    async def scenario():
        async with _mesh("lost", "lost") as (computes, _, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_request("req-l"), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            error = error_from_rpc(info.value)
            assert type(error) is KVMemoryLost and error.message == "the KV memory shrank to 4 rBlocks"
            assert sorted(len(c.ids) for c in computes) == [0, 1]  # sent once, to one instance

    asyncio.run(scenario())
