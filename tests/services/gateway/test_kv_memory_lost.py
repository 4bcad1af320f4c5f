"""A request whose KV the cluster lost for good (attention servers left; it waited for memory to come back)
reaches an OpenAI client as a 503 ``server_error`` naming what happened, not as the client's 400
``context_length_exceeded``: the request was fine and may succeed once the cluster has its memory again. The
real gateway app, over a real router on loopback whose one compute instance (a real gRPC server, no model)
answers every request with ``KVMemoryLost``, as the scheduler does (``core/scheduler.py``)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from infinite_llm.core.errors import KVMemoryLost
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.gateway.app import create_app
from infinite_llm.services.gateway.backend import RouterBackend
from infinite_llm.services.router.servicer import RouterServicer
from tests.services.gateway.conftest import MAX_MODEL_LEN

LOST = (
    "the KV memory shrank to 4 rBlocks of 16 tokens in all (attention servers left) and this request's 90 tokens "
    "need 6; it waited 120 s for memory to come back: retry once the cluster has its attention servers again"
)


class Lost(cgrpc.ComputeInstanceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        self.calls += 1
        raise KVMemoryLost(LOST)
        yield  # an async generator, as the real servicer's stream


@pytest.fixture(scope="module")
def mesh(tokenizer):
    """(router address, the compute servicer), served on an event loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    compute = Lost()

    async def start():
        cserver = await start_server(
            [Service.of(cpb, "ComputeInstance", cgrpc.add_ComputeInstanceServicer_to_server, compute)],
            "127.0.0.1:0",
            tls=None,
        )
        router = RouterServicer([f"127.0.0.1:{cserver.port}"], "smollm2", MAX_MODEL_LEN, tokenizer)
        rserver = await start_server(
            [Service.of(rpb, "Router", rgrpc.add_RouterServicer_to_server, router)], "127.0.0.1:0", tls=None
        )
        return cserver, rserver

    servers = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield f"127.0.0.1:{servers[1].port}", compute
    for s in servers:
        asyncio.run_coroutine_threadsafe(s.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_kv_memory_lost_is_a_503_server_error_unary_and_streamed(mesh, tokenizer):
    address, compute = mesh
    want = {"message": LOST, "type": "server_error", "param": None, "code": None}
    with TestClient(create_app(RouterBackend(address, tokenizer, tls=None))) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert r.json() == {"error": want}
        assert compute.calls == 1  # not retried: every compute instance shares the same KV memory
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 503, r.text  # nothing was streamed yet: the status still says it
        assert r.json() == {"error": want}
