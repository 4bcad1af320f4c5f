"""The SDK resends a call the router ended UNAVAILABLE before answering, and never one it had answered.

A fault-injecting gRPC proxy on loopback stands in front of the session mesh's real router: it refuses the
first calls with UNAVAILABLE (what a draining or restarting router says), then forwards them; or it ends a
stream with UNAVAILABLE after forwarding its first message. The proxy counts the attempts that reach it, so
each test knows exactly how often the client sent.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from infinite_llm.client import AsyncClient, Client, InvalidRequest, Unavailable
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.state.etcd_launcher import free_port

PROMPT = "The three primary colours are"
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


class FaultyRouter(rgrpc.RouterServicer):
    """Forwards Generate and GenerateStream to ``upstream`` after refusing the first ``refuse`` attempts;
    with ``cut_stream``, a stream ends UNAVAILABLE after its first forwarded message."""

    def __init__(self, upstream: rgrpc.RouterStub) -> None:
        self.upstream = upstream
        self.refuse = 0
        self.cut_stream = False
        self.attempts = 0
        self._lock = threading.Lock()

    def _admit(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.attempts += 1
            refused = self.attempts <= self.refuse
        if refused:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the router is restarting")

    def Generate(self, request, context):  # noqa: N802 - gRPC method name
        self._admit(context)
        return self.upstream.Generate(request, timeout=120)

    def GenerateStream(self, request, context):  # noqa: N802 - gRPC method name
        self._admit(context)
        for i, msg in enumerate(self.upstream.GenerateStream(request, timeout=120)):
            if self.cut_stream and i == 1:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the router went away mid-stream")
            yield msg


@pytest.fixture(scope="module")
def proxy(mesh):
    with sync_channel(mesh.router_address, tls=mesh.tls("client")) as channel:
        faulty = FaultyRouter(rgrpc.RouterStub(channel))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rgrpc.add_RouterServicer_to_server(faulty, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        yield faulty, f"127.0.0.1:{port}"
        server.stop(grace=None)


@pytest.fixture(scope="module")
def reference(mesh):
    with Client(mesh.router_address) as client:
        return client.generate(PROMPT, **GREEDY).token_ids


def arm(faulty: FaultyRouter, refuse: int = 0, cut_stream: bool = False) -> None:
    faulty.refuse, faulty.cut_stream, faulty.attempts = refuse, cut_stream, 0


@pytest.mark.parametrize("max_retries", [2, 4])
def test_a_refused_call_is_resent_until_the_router_answers(proxy, reference, max_retries):
    faulty, address = proxy
    with Client(address, tls=None, max_retries=max_retries) as client:
        arm(faulty, refuse=max_retries)
        assert client.generate(PROMPT, **GREEDY).token_ids == reference
        assert faulty.attempts == max_retries + 1
        arm(faulty, refuse=max_retries)
        streamed = [t for chunk in client.stream(PROMPT, **GREEDY) for t in chunk.token_ids]
        assert streamed == reference and faulty.attempts == max_retries + 1


def test_retries_give_up_after_max_retries_and_zero_sends_once(proxy):
    faulty, address = proxy
    with Client(address, tls=None, max_retries=2) as client:
        arm(faulty, refuse=3)
        with pytest.raises(Unavailable, match="the router is restarting"):
            client.generate(PROMPT, **GREEDY)
        assert faulty.attempts == 3
    with Client(address, tls=None, max_retries=0) as client:
        arm(faulty, refuse=1)
        with pytest.raises(Unavailable, match="the router is restarting"):
            client.generate(PROMPT, **GREEDY)
        assert faulty.attempts == 1


def test_a_stream_that_already_sent_tokens_is_never_resent(proxy, reference):
    faulty, address = proxy
    with Client(address, tls=None, max_retries=4) as client:
        arm(faulty, cut_stream=True)
        got = []
        with pytest.raises(Unavailable, match="mid-stream"):
            for chunk in client.stream(PROMPT, **GREEDY):
                got.extend(chunk.token_ids)
        assert faulty.attempts == 1  # no second attempt: it would produce the first tokens twice
        assert got and got == reference[: len(got)]


def test_the_async_client_resends_too(proxy, reference):
    faulty, address = proxy

    async def run() -> list[int]:
        async with AsyncClient(address, tls=None, max_retries=2) as client:
            return (await client.generate(PROMPT, **GREEDY)).token_ids

    arm(faulty, refuse=2)
    assert asyncio.run(run()) == reference and faulty.attempts == 3


@pytest.mark.parametrize("bad", [-1, 5, 1.5, True, "2"])
def test_max_retries_outside_0_to_4_is_refused(bad):
    with pytest.raises(InvalidRequest, match="max_retries must be an integer from 0 to 4") as e:
        Client("127.0.0.1:1", tls=None, max_retries=bad)
    assert e.value.param == "max_retries"
