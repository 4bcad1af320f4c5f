"""Per-call deadlines on the data plane: a layer reply an attention server owes for too long is given up on
(``Unavailable``, its call cancelled) within the stall limit, not at the step's deadline. A real gRPC server
on loopback that opens the step and then never answers (as a paused server)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from infinite_llm.core.dist_attention import HolderId, LayerInput
from infinite_llm.core.errors import DeadlineExceeded, Unavailable
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.compute.grpc_transport import GrpcTransport
from infinite_llm.services.compute.stall_watch import StallWatch


class Silent(agrpc.AttentionServerServicer):
    """Reads the step's messages and answers none of them."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    async def AttendStream(self, request_iterator, context):  # noqa: N802, ANN001
        context.add_done_callback(lambda _ctx: self.cancelled.set())
        async for _ in request_iterator:
            pass
        await asyncio.sleep(60)
        yield apb.LayerPartial()


@pytest.fixture
def silent_server():
    servicer, started, stop = Silent(), threading.Event(), None
    box = {}

    def run() -> None:
        async def main() -> None:
            nonlocal stop
            stop = asyncio.Event()
            service = Service.of(apb, "AttentionServer", agrpc.add_AttentionServerServicer_to_server, servicer)
            server = await start_server([service], "127.0.0.1:0")
            box["address"] = f"127.0.0.1:{server.port}"
            started.set()
            await stop.wait()
            await server.stop(0)

        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield servicer, box["address"]
    box["loop"].call_soon_threadsafe(stop.set)
    thread.join(10)


def test_a_server_that_stops_answering_is_unavailable_within_the_stall_limit(silent_server):
    servicer, address = silent_server
    server = HolderId("attn-0")
    transport = GrpcTransport(lambda _s: address, timeout_s=30.0)
    transport.stall = StallWatch(min_s=0.5)
    transport.open_step(1, {server: [SeqStep("s", 0, 1)]}, num_heads=1)
    x = LayerInput(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    start = time.monotonic()
    with pytest.raises(Unavailable, match="attention server attn-0 stalled: no reply to layer 0"):
        transport.attend(1, 0, {server: x})
    assert 0.5 <= time.monotonic() - start < 3.0  # not the step's 30 s deadline
    transport.close_step(1, failed=True)
    assert servicer.cancelled.wait(5)  # the server saw the call end: it drops the step's plan


def test_a_step_past_its_deadline_is_deadline_exceeded(silent_server):
    """A step's deadline holds although its stream outlives it: the transport enforces it on each reply."""
    servicer, address = silent_server
    server = HolderId("attn-0")
    transport = GrpcTransport(lambda _s: address, timeout_s=0.5)
    transport.stall = StallWatch(min_s=30.0)  # the stall limit is not what fires
    transport.open_step(1, {server: [SeqStep("s", 0, 1)]}, num_heads=1)
    x = LayerInput(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"a step's deadline \(0.5 s\) passed at layer 0 of attn-0"):
        transport.attend(1, 0, {server: x})
    assert 0.5 <= time.monotonic() - start < 3.0
    transport.close_step(1, failed=True)
    assert servicer.cancelled.wait(5)


def test_the_limit_follows_a_servers_slowest_recent_reply():
    watch = StallWatch(min_s=2.0, factor=8.0)
    assert watch.limit("a") == 2.0
    for seconds in (0.01, 0.5, 0.02):
        watch.observe("a", seconds)
    assert (watch.limit("a"), watch.limit("b")) == (4.0, 2.0)
