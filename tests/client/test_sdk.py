"""The SDK's own checks (``infinite_llm/client/sdk.py``): a timeout that is not a positive, finite number of
seconds is the caller's error (InvalidRequest naming ``timeout``), raised before any RPC reaches the server;
gRPC itself would report it as DEADLINE_EXCEEDED, as if the mesh were slow."""

from __future__ import annotations

import asyncio
import math
from concurrent import futures

import grpc
import pytest

from infinite_llm.client import AsyncClient, Client, InvalidRequest
from infinite_llm.client.errors import InfiniteLLMError


@pytest.fixture
def server():
    """A gRPC server that records each method called and implements none (UNIMPLEMENTED)."""
    calls: list[str] = []

    class Recorder(grpc.GenericRpcHandler):
        def service(self, details):
            calls.append(details.method)
            return None

    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    srv.add_generic_rpc_handlers((Recorder(),))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", calls
    srv.stop(None)


BAD_TIMEOUTS = [-1, 0, 0.0, -0.5, math.inf, math.nan, "10", True]
CALLS = {
    "generate": lambda c, t: c.generate("hi", timeout=t),
    "stream": lambda c, t: list(c.stream("hi", timeout=t)),
    "abort": lambda c, t: c.abort("cmpl-1", timeout=t),
    "list_models": lambda c, t: c.list_models(timeout=t),
    "tokenize": lambda c, t: c.tokenize("hi", timeout=t),
}


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
@pytest.mark.parametrize("method", sorted(CALLS))
def test_a_bad_timeout_is_invalid_request_before_any_rpc(server, method, timeout):
    address, calls = server
    with Client(address, tls=None) as client, pytest.raises(InvalidRequest) as e:
        CALLS[method](client, timeout)
    assert e.value.param == "timeout"
    assert f"timeout must be a positive, finite number of seconds, got {timeout!r}" in e.value.message
    assert calls == []


def test_a_positive_timeout_reaches_the_server(server):
    address, calls = server
    with Client(address, tls=None) as client, pytest.raises(InfiniteLLMError) as e:
        client.generate("hi", timeout=5)
    assert not isinstance(e.value, InvalidRequest)  # the server's UNIMPLEMENTED, not our check
    assert calls == ["/infinite_llm.v1.Router/Generate"]


@pytest.mark.parametrize("timeout", [-1, 0, math.inf])
def test_the_async_client_refuses_a_bad_timeout_before_any_rpc(server, timeout):
    address, calls = server

    async def stream_all(client):
        return [chunk async for chunk in client.stream("hi", timeout=timeout)]

    async def main():
        async with AsyncClient(address, tls=None) as client:
            for call in (
                lambda: client.generate("hi", timeout=timeout),
                lambda: stream_all(client),
                lambda: client.abort("cmpl-1", timeout=timeout),
                lambda: client.list_models(timeout=timeout),
            ):
                with pytest.raises(InvalidRequest) as e:
                    await call()
                assert e.value.param == "timeout"

    asyncio.run(main())
    assert calls == []


def test_a_router_that_is_not_there_is_unavailable_after_the_retries_or_past_the_deadline_while_waiting():
    from infinite_llm.client import DeadlineExceeded, Unavailable
    from infinite_llm.state.etcd_launcher import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens: every attempt is refused
    for retries in (0, 2):
        with Client(address, tls=None, max_retries=retries) as client, pytest.raises(Unavailable):
            client.generate("hi", timeout=30)
    # 4 resends wait up to 0.5 + 1 + 2 + 4 s at random: a 0.3 s deadline passes first (all but ~1e-4 of runs)
    with Client(address, tls=None, max_retries=4) as client, pytest.raises(DeadlineExceeded):
        client.generate("hi", timeout=0.3)


def test_requests_the_sdk_cannot_encode_fail_before_any_rpc_naming_what_is_wrong(server):
    """A misspelt keyword is Python's TypeError naming ``generate()`` with the close match (not the
    encoder's function); ``max_tokens=None`` says None (it used to travel as 0, and the router said 0);
    text that is not valid Unicode names the field that holds it."""
    address, calls = server
    with Client(address, tls=None) as client:
        with pytest.raises(
            TypeError,
            match=r"^generate\(\) got an unexpected keyword argument 'tempurature'; did you mean 'temperature'\?$",
        ):
            client.generate("hi", tempurature=0.5)
        with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
            list(client.stream("hi", colour="blue"))
        with pytest.raises(InvalidRequest, match="^max_tokens must be a positive integer, got None$") as e:
            client.generate("hi", max_tokens=None)
        assert e.value.param == "max_tokens"
        for kwargs, param in [({"prompt": "a\ud800b"}, "prompt"), ({"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop")]:
            with pytest.raises(InvalidRequest, match="not valid Unicode|surrogates not allowed") as e:
                client.generate(**kwargs)
            assert e.value.param == param
    assert calls == []


def test_a_plaintext_client_refused_by_an_mtls_router_is_told_about_tls(tmp_path):
    """gRPC reports a plaintext client whose handshake an mTLS server refuses as UNAVAILABLE 'Socket closed',
    which reads as a router that is down: the SDK says what to try."""
    from infinite_llm.client import Unavailable
    from infinite_llm.rpc.certs import write_tls_dir
    from infinite_llm.rpc.tls import load_tls_dir

    write_tls_dir(tmp_path, roles=("router",))
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = srv.add_secure_port("127.0.0.1:0", load_tls_dir(tmp_path, "router").server_credentials())
    srv.start()
    try:
        with Client(f"127.0.0.1:{port}", tls=None, max_retries=0) as client, pytest.raises(Unavailable) as e:
            client.list_models(timeout=10)
    finally:
        srv.stop(None)
    assert "Socket closed" in e.value.message and "this client speaks plaintext" in e.value.message
