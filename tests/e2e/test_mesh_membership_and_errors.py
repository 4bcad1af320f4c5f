"""Membership through etcd leases, and bad input to every service of a real mesh."""

from __future__ import annotations

import time

import grpc
import pytest

from infinite_llm.client import Client, InvalidRequest, NotFound
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import tensor_pb2 as tpb
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import mesh_channel, server_stats


def _ids(mesh) -> set[str]:
    return {s.server_id for s in cluster_state(mesh.manager_address).servers}


def test_a_new_server_appears_and_a_killed_one_disappears_after_its_lease(mesh):
    assert _ids(mesh) == {"attn-0", "attn-1", "attn-2"}
    extra = mesh.spawn_attention("attn-extra")
    deadline = time.monotonic() + 60
    while "attn-extra" not in _ids(mesh):
        assert time.monotonic() < deadline, "new server never registered"
        time.sleep(0.2)
    extra.popen.kill()  # no goodbye: only the lease expiry can remove it
    extra.popen.wait()
    killed_at = time.monotonic()
    while "attn-extra" in _ids(mesh):
        assert time.monotonic() - killed_at < 15, "dead server still listed"
        time.sleep(0.2)
    assert time.monotonic() - killed_at >= 1.0  # it went by lease expiry (ttl 3 s), not instantly
    assert _ids(mesh) == {"attn-0", "attn-1", "attn-2"}


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"max_tokens": 0}, InvalidRequest, "max_tokens"),
        ({"max_tokens": 4, "temperature": -1.0}, InvalidRequest, "temperature"),
        ({"max_tokens": 4, "top_p": 1.5}, InvalidRequest, "top_p"),
        ({"max_tokens": 4, "top_k": 0}, InvalidRequest, "top_k"),
        ({"max_tokens": 4, "model": "gpt-17"}, NotFound, "gpt-17"),
    ],
)
def test_router_rejects_bad_parameters_and_keeps_serving(mesh, kwargs, error, match):
    with Client(mesh.router_address) as c:
        with pytest.raises(error, match=match):
            c.generate("hello", **kwargs)
        assert c.generate("hello", max_tokens=2, temperature=0).finish_reason == "length"


def test_router_rejects_bad_prompts(mesh):
    with Client(mesh.router_address) as c:
        with pytest.raises(InvalidRequest, match="empty"):
            c.generate("", max_tokens=2)
        with pytest.raises(InvalidRequest, match="vocabulary"):
            c.generate([1, 2, 10**6], max_tokens=2)
        with pytest.raises(InvalidRequest, match="maximum length"):
            c.generate("hi", max_tokens=9000)
        assert c.generate("hello", max_tokens=2, temperature=0).finish_reason == "length"


def _stream_code(stub, messages) -> grpc.StatusCode:  # noqa: ANN001
    """Status of an AttendStream that sends ``messages`` and half-closes."""
    return _code(lambda timeout: list(stub.AttendStream(iter(messages), timeout=timeout)))


def _code(fn, *args) -> grpc.StatusCode:
    try:
        fn(*args, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_attention_server_rejects_malformed_tensors_and_unknown_sequences(mesh):
    address = mesh.attention_servers()[0].address
    with mesh_channel(address, "compute") as ch:
        stub = agrpc.AttentionServerStub(ch)
        opening = apb.AttendStreamRequest(
            open=apb.StepOpen(step_id=1, num_heads=9, seqs=[apb.StepSeq(seq_id="nope", num_new=1)])
        )
        assert _stream_code(stub, [opening]) == grpc.StatusCode.NOT_FOUND  # the step names an unknown sequence
        bad_dtype = apb.AttendStreamRequest(
            layer=apb.LayerInput(layer=0, query=tpb.Tensor(dtype="complex7", shape=[1, 9, 64], data=b""))
        )
        assert _stream_code(stub, [bad_dtype]) == grpc.StatusCode.INVALID_ARGUMENT  # no StepOpen first
        no_heads = apb.AttendStreamRequest(
            open=apb.StepOpen(step_id=1, num_heads=0, seqs=[apb.StepSeq(seq_id="x", num_new=1)])
        )
        assert _stream_code(stub, [no_heads]) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(stub.CommitBlocks, apb.CommitBlocksRequest(reservation_id=987654)) == grpc.StatusCode.NOT_FOUND
        assert (
            _code(stub.ReserveBlocks, apb.ReserveBlocksRequest(seq_id="x", num_blocks=10**6))
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert server_stats(address).num_reserved == 0  # the next valid call works and nothing leaked


def test_manager_rejects_bad_placements(mesh):
    with mesh_channel(mesh.manager_address, "compute") as ch:
        stub = mgrpc.GlobalManagerStub(ch)
        assert _code(stub.Place, mpb.PlaceRequest(seq_id="s", num_blocks=0)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(stub.Place, mpb.PlaceRequest(seq_id="s", num_blocks=10**6)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _code(stub.Release, mpb.ReleaseRequest(seq_id="never-placed")) == grpc.StatusCode.NOT_FOUND
        assert len(cluster_state(mesh.manager_address).servers) == 3


def test_compute_instance_rejects_bad_requests(mesh):
    with mesh_channel(mesh.compute_instances()[0].address, "router") as ch:
        stub = cgrpc.ComputeInstanceStub(ch)
        no_prompt = gpb.GenerateRequest(sampling=gpb.SamplingParams(max_tokens=3))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(no_prompt, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(max_tokens=2, temperature=0))
        assert list(stub.Generate(ok, timeout=30))[-1].finish_reason == "length"
