"""The common server over real loopback gRPC: error mapping, request ids, health, reflection, stop, channels."""

import asyncio
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from infinite_llm.core.errors import CapacityExhausted, InvalidRequest, NotFound, Unavailable
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as pb_grpc
from infinite_llm.rpc.channels import Deadline, DeadlineExceeded, aio_channel, sync_channel
from infinite_llm.rpc.interceptors import REQUEST_ID_KEY, current_request_id
from infinite_llm.rpc.interceptors.request_id import use_request_id
from infinite_llm.rpc.server import Service, start_server

SERVICE = "infinite_llm.v1.AttentionServer"


SLOW_STARTED = threading.Event()  # set when a FreeSequence of "slow" reached its handler


class ProbeServicer(pb_grpc.AttentionServerServicer):
    """A real AttentionServer implementation whose methods misbehave on purpose."""

    async def GetStats(self, request, context):
        """Reports what the server saw: the request id and the call's remaining seconds."""
        return pb.GetStatsResponse(server_id=current_request_id() or "", num_blocks=int(context.time_remaining()))

    async def FreeSequence(self, request, context):
        if request.seq_id == "typed":
            raise NotFound("no sequence 'typed'")
        if request.seq_id == "bug":
            raise RuntimeError("boom")
        if request.seq_id == "slow":
            SLOW_STARTED.set()
            await asyncio.sleep(0.5)
        return pb.FreeSequenceResponse(num_freed=7)

    async def ExportBlocks(self, request, context):
        yield pb.BlockTransferChunk(data=b"first")
        raise CapacityExhausted("out of rBlocks mid-stream")

    async def ImportBlocks(self, request_iterator, context):
        n = 0
        async for _ in request_iterator:
            n += 1
        if n > 2:
            raise InvalidRequest(f"{n} chunks is too many")
        return pb.ImportBlocksResponse(block_ids=[n])


@pytest.fixture
def server(loop):
    service = Service.of(pb, "AttentionServer", pb_grpc.add_AttentionServerServicer_to_server, ProbeServicer())
    rpc = loop.run(start_server([service]))
    yield rpc
    loop.run(rpc.stop(0))


@pytest.fixture
def channel(server):
    with sync_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def _code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10, **kwargs)
    return info.value.code(), info.value.details()


def test_typed_errors_become_their_status_code_and_the_server_keeps_serving(channel):
    stub = pb_grpc.AttentionServerStub(channel)
    assert _code(stub.FreeSequence, pb.FreeSequenceRequest(seq_id="typed")) == (
        grpc.StatusCode.NOT_FOUND,
        "no sequence 'typed'",
    )
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="ok"), timeout=10).num_freed == 7


def test_unexpected_exceptions_become_internal_with_the_request_id(channel):
    stub = pb_grpc.AttentionServerStub(channel)
    code, details = _code(stub.FreeSequence, pb.FreeSequenceRequest(seq_id="bug"), metadata=[(REQUEST_ID_KEY, "r-1")])
    assert code == grpc.StatusCode.INTERNAL
    assert details == "internal error (RuntimeError); request id r-1"
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="ok"), timeout=10).num_freed == 7


def test_errors_in_streams_keep_their_codes(channel):
    stub = pb_grpc.AttentionServerStub(channel)
    stream = stub.ExportBlocks(pb.ExportBlocksRequest(), timeout=10)
    assert next(stream).data == b"first"
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "out of rBlocks mid-stream"
    chunks = iter([pb.BlockTransferChunk(data=b"x")] * 3)
    assert _code(stub.ImportBlocks, chunks) == (grpc.StatusCode.INVALID_ARGUMENT, "3 chunks is too many")
    assert stub.ImportBlocks(iter([pb.BlockTransferChunk()] * 2), timeout=10).block_ids == [2]


def test_request_id_is_echoed_or_generated_and_survives_errors(channel):
    stub = pb_grpc.AttentionServerStub(channel)
    reply, call = stub.GetStats.with_call(pb.GetStatsRequest(), metadata=[(REQUEST_ID_KEY, "abc-123")], timeout=10)
    assert reply.server_id == "abc-123"
    assert dict(call.trailing_metadata())[REQUEST_ID_KEY] == "abc-123"
    for metadata in ([], [(REQUEST_ID_KEY, "has spaces")]):
        reply, call = stub.GetStats.with_call(pb.GetStatsRequest(), metadata=metadata, timeout=10)
        assert re.fullmatch("[0-9a-f]{32}", reply.server_id)
        assert dict(call.trailing_metadata())[REQUEST_ID_KEY] == reply.server_id
    with pytest.raises(grpc.RpcError) as info:
        stub.FreeSequence(pb.FreeSequenceRequest(seq_id="typed"), metadata=[(REQUEST_ID_KEY, "e-9")], timeout=10)
    assert dict(info.value.trailing_metadata())[REQUEST_ID_KEY] == "e-9"


def test_health_reports_serving_for_the_server_and_each_service(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _code(health.Check, health_pb2.HealthCheckRequest(service="nope"))[0] == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_every_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = sorted(s.name for s in reply.list_services_response.service)
    assert names == sorted([SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"])


def test_aio_channel_forwards_the_request_id_and_sets_a_default_deadline(loop, server):
    async def call():
        async with aio_channel(f"127.0.0.1:{server.port}", timeout_s=12.0) as ch:
            stub = pb_grpc.AttentionServerStub(ch)
            with use_request_id("trace-7"):
                traced = await stub.GetStats(pb.GetStatsRequest())
            explicit = await stub.GetStats(pb.GetStatsRequest(), timeout=100)
        return traced, explicit

    traced, explicit = loop.run(call())
    assert traced.server_id == "trace-7" and 10 <= traced.num_blocks <= 12
    assert re.fullmatch("[0-9a-f]{32}", explicit.server_id) and 95 <= explicit.num_blocks <= 100


def test_graceful_stop_lets_in_flight_calls_finish_and_refuses_new_ones(loop, server):
    with sync_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.AttentionServerStub(ch)
        SLOW_STARTED.clear()
        in_flight = stub.FreeSequence.future(pb.FreeSequenceRequest(seq_id="slow"), timeout=10)
        assert SLOW_STARTED.wait(10)  # in flight: its handler runs (the channel connects lazily)
        loop.run(server.stop(grace=5))
        assert in_flight.result().num_freed == 7
        assert _code(stub.FreeSequence, pb.FreeSequenceRequest(seq_id="ok"))[0] == grpc.StatusCode.UNAVAILABLE


def test_a_taken_port_is_refused(loop, server):
    with pytest.raises(Unavailable, match=f"127.0.0.1:{server.port}"):
        loop.run(start_server([], f"127.0.0.1:{server.port}"))


def test_deadline_shrinks_and_expires():
    d = Deadline.after(0.05)
    assert 0 < d.remaining() <= 0.05
    time.sleep(0.06)
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        d.remaining()


def test_a_slow_handshake_gets_the_calls_deadline_not_a_quarter_second():
    """A peer that accepts TCP and is slow to answer (a TLS handshake on a busy machine) must get the whole
    call deadline: with ``grpc.min_reconnect_backoff_ms`` set to 250 ms, C-core gave each connection attempt
    250 ms and the call failed UNAVAILABLE ("connection attempt timed out before receiving SETTINGS frame")
    after ~0.3 s. Both channel kinds, with the project's channel options."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []  # held open, never answered
    threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(8)], daemon=True).start()
    target = f"127.0.0.1:{listener.getsockname()[1]}"

    def code_after(call) -> tuple[grpc.StatusCode, float]:  # noqa: ANN001
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value.code(), time.monotonic() - start

    request = pb.GetStatsRequest()
    with sync_channel(target, tls=None) as ch:
        code, seconds = code_after(lambda: pb_grpc.AttentionServerStub(ch).GetStats(request, timeout=2))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds >= 1.9, (code, seconds)

    async def aio_call() -> None:
        async with aio_channel(target, tls=None) as ch:
            await pb_grpc.AttentionServerStub(ch).GetStats(request, timeout=2)

    code, seconds = code_after(lambda: asyncio.run(aio_call()))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds >= 1.9, (code, seconds)
    listener.close()


def test_health_watch_streams_through_an_interceptor_that_iterates_streamed_responses():
    """OpenTelemetry's aio server instrumentation iterates a server-streaming handler's responses; the stock
    asyncio health servicer's Watch writes to its context instead and failed under it (TypeError), which made
    gRPC's client-side health checking (``serving_only``) see every manager unhealthy. Ours yields."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    from infinite_llm.rpc.options import serving_only

    async def scenario():
        servicer = ProbeServicer()
        service = Service.of(pb, "AttentionServer", pb_grpc.add_AttentionServerServicer_to_server, servicer)
        server = await start_server(
            [service], "127.0.0.1:0", interceptors=[aio_server_interceptor()], tls=None, not_serving=[SERVICE]
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
                assert (await call.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                await server.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
                assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
                call.cancel()
            # gRPC's own client-side health checking over the same Watch: calls are admitted once SERVING
            async with aio_channel(f"127.0.0.1:{server.port}", tls=None, extra_options=serving_only(SERVICE)) as ch:
                reply = await pb_grpc.AttentionServerStub(ch).FreeSequence(
                    pb.FreeSequenceRequest(seq_id="s"), timeout=5
                )
                assert reply.num_freed == 7
        finally:
            await server.stop(0)

    asyncio.run(scenario())
