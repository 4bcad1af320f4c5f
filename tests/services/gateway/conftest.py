"""The gateway tests' router: a real router of a real tokenizer whose only compute instance is unreachable,
so every request these tests make is decided by the gateway or the router before a compute instance would
be asked (a request that passes gets 503)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.router.servicer import RouterServicer

MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from infinite_llm.models.registry import load_model_config, load_tokenizer, resolve_model

    resolved = resolve_model(None)
    return load_tokenizer(resolved, load_model_config(resolved))


@pytest.fixture(scope="module")
def router_address(tokenizer):
    """HOST:PORT of a real router of an 8192-token model (its only compute instance, port 1, unreachable),
    served on its own event loop in a thread, as a separate process would be."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        router = RouterServicer(["127.0.0.1:1"], "smollm2", MAX_MODEL_LEN, tokenizer)
        service = Service.of(rpb, "Router", rgrpc.add_RouterServicer_to_server, router)
        return await start_server([service], "127.0.0.1:0", tls=None)

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield f"127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
