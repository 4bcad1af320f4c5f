"""One request's bad input touches that request only, on a real mesh: request ids with ``/`` or 2 MB long are
refused at the router and at the compute instance (INVALID_ARGUMENT) while other requests stream on to their
undisturbed greedy tokens; bytes that are not a request message are INVALID_ARGUMENT on every service; a
prompt over the gRPC message limit is ``InvalidRequest`` before anything is reserved."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.client import Client, InvalidRequest
from infinite_llm.core.errors import MessageTooLarge
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.errors import ERROR_PARAM_KEY, ERROR_REASON_KEY
from infinite_llm.rpc.options import MAX_MESSAGE_BYTES
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import all_blocks_free, mesh_channel, wait_until

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()
BAD_IDS = {"slash": "tenant/req-1", "2MB": "r" * 2_000_000, "newline": "req\n1", "space": "req 1"}
PARAMS = dict(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts() -> dict[str, str]:
    words = TEXT.split()
    return {f"good-{i}": " ".join(words[i * 40 : i * 40 + 12 + 5 * i]) for i in range(3)}


@pytest.fixture(scope="module")
def undisturbed(mesh) -> dict[str, list[int]]:
    """Each good prompt's greedy tokens, run alone."""
    with Client(mesh.router_address) as c:
        return {rid: c.generate(p, **PARAMS).token_ids for rid, p in _prompts().items()}


def _refusal(call) -> grpc.RpcError:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _call_raw(address: str, method: str, kind: str, payload: bytes) -> None:
    """Send ``payload`` as the request bytes of ``method`` (``kind``: ``unary_unary``...), read every reply."""
    caller = {"AttentionServer": "compute", "GlobalManager": "compute", "ComputeInstance": "router", "Router": "client"}
    with mesh_channel(address, caller[method.split("/")[1].split(".")[-1]]) as ch:
        call = getattr(ch, kind)(method)
        replies = call(iter([payload]) if kind.startswith("stream") else payload, timeout=10)
        if kind.endswith("stream"):
            list(replies)


def _serving(address: str, service: str) -> bool:
    with mesh_channel(address, "client") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_bad_request_ids_fail_alone_while_other_requests_stream_on(mesh, undisturbed):
    started, results = threading.Barrier(len(undisturbed) + 1), {}

    def run(rid: str, prompt: str) -> None:
        with Client(mesh.router_address) as c:
            stream = c.stream(prompt, request_id=rid, **PARAMS)
            chunks = [next(stream)]
            started.wait(60)  # every good request is in flight before the bad ones arrive
            chunks += list(stream)
            results[rid] = [t for ch in chunks for t in ch.token_ids]

    threads = [threading.Thread(target=run, args=item) for item in _prompts().items()]
    for t in threads:
        t.start()
    started.wait(120)
    with Client(mesh.router_address) as c:  # the router refuses them before any compute instance sees them
        for bad in BAD_IDS.values():
            with pytest.raises(InvalidRequest) as e:
                c.generate("hello", request_id=bad, max_tokens=4)
            assert type(e.value) is InvalidRequest and e.value.param == "request_id"
    with mesh_channel(mesh.compute_instances()[0].address, "router") as ch:  # and so does a compute instance
        stub = cgrpc.ComputeInstanceStub(ch)
        for bad in BAD_IDS.values():
            request = gpb.GenerateRequest(request_id=bad, text="hello", sampling=gpb.SamplingParams(max_tokens=4))
            e = _refusal(lambda r=request: list(stub.Generate(r, timeout=30)))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            trailers = dict(e.trailing_metadata())
            assert (trailers[ERROR_REASON_KEY], trailers[ERROR_PARAM_KEY]) == ("INVALID_REQUEST", "request_id")
    for t in threads:
        t.join(120)
    assert results == undisturbed  # every good request finished, with its undisturbed greedy tokens
    assert wait_until(lambda: all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger)
    assert _serving(mesh.router_address, "infinite_llm.v1.Router")
    assert _serving(mesh.compute_instances()[0].address, "infinite_llm.v1.ComputeInstance")


def test_the_manager_refuses_bad_sequence_ids_without_reaching_etcd(mesh):
    with mesh_channel(mesh.manager_address, "compute") as ch:
        stub = mgrpc.GlobalManagerStub(ch)
        for bad in BAD_IDS.values():
            e = _refusal(lambda b=bad: stub.Place(mpb.PlaceRequest(seq_id=b, num_blocks=1, block_size=16), timeout=10))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT  # a 2 MB key came back UNAVAILABLE from etcd
            e = _refusal(lambda b=bad: stub.Release(mpb.ReleaseRequest(seq_id=b), timeout=10))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(cluster_state(mesh.manager_address).servers) == 3 and all_blocks_free(mesh)


def test_bytes_that_are_no_request_message_are_invalid_argument_on_every_service(mesh):
    calls = [
        (mesh.router_address, "/infinite_llm.v1.Router/Generate", "unary_unary"),
        (mesh.router_address, "/infinite_llm.v1.Router/GenerateStream", "unary_stream"),
        (mesh.compute_instances()[0].address, "/infinite_llm.v1.ComputeInstance/Generate", "unary_stream"),
        (mesh.manager_address, "/infinite_llm.v1.GlobalManager/Place", "unary_unary"),
        (mesh.attention_servers()[0].address, "/infinite_llm.v1.AttentionServer/ReserveBlocks", "unary_unary"),
        (mesh.attention_servers()[0].address, "/infinite_llm.v1.AttentionServer/AttendStream", "stream_stream"),
        (mesh.attention_servers()[0].address, "/infinite_llm.v1.AttentionServer/ImportBlocks", "stream_unary"),
    ]
    for garbage in (b"\xff\xff\xff\xff\xff", b"\x0a\x03\xed\xa0\x80"):  # not protobuf; a surrogate in UTF-8
        for address, method, kind in calls:
            e = _refusal(lambda a=address, m=method, k=kind, g=garbage: _call_raw(a, m, k, g))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.code(), e.details())
    with Client(mesh.router_address) as c:
        assert c.generate("hello", max_tokens=2, temperature=0).finish_reason == "length"
    with mesh_channel(mesh.attention_servers()[0].address, "manager") as ch:
        assert (
            ch.unary_unary(
                "/infinite_llm.v1.AttentionServer/GetStats",
                request_serializer=apb.GetStatsRequest.SerializeToString,
                response_deserializer=apb.GetStatsResponse.FromString,
            )(apb.GetStatsRequest(), timeout=10).num_blocks
            > 0
        )


def test_a_prompt_over_the_grpc_message_limit_is_invalid_before_anything_is_reserved(mesh):
    huge = "a" * (MAX_MESSAGE_BYTES + 1024)
    with Client(mesh.router_address) as c:
        with pytest.raises(MessageTooLarge) as e:
            c.generate(huge, max_tokens=2)
        assert isinstance(e.value, InvalidRequest) and e.value.grpc_code == "INVALID_ARGUMENT"
        assert e.value.param == "prompt" and e.value.http_status == 400
        assert c.generate("hello", max_tokens=2, temperature=0).finish_reason == "length"
    assert all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger
