"""Malformed gRPC input, service by service, on the session's real mesh (issue 11: at least 30 kinds per
service, each with the right status, the service still healthy, other requests still correct).

Each table row sends one malformed request, as raw bytes on the wire (so bytes protobuf cannot parse go out
as they are), to one service with the role that may call it, and asserts the exact status code. After each
service's table its health check still answers SERVING, a correct request through the router still gets
its greedy tokens, and no rBlock or ledger entry is left behind.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import tensor_pb2 as tpb
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import all_blocks_free, mesh_channel, wait_until

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
EXHAUSTED, PRECONDITION = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION
LONG_ID = "r" * 2_000_000
PROMPT = "The capital of France is"
ROLE = {"Router": "client", "ComputeInstance": "router", "GlobalManager": "compute", "AttentionServer": "compute"}
KIND = {  # the call shape of each method the tables use (the others are unary_unary)
    "Router/GenerateStream": "unary_stream",
    "ComputeInstance/Generate": "unary_stream",
    "AttentionServer/ExportBlocks": "unary_stream",
    "AttentionServer/AttendStream": "stream_stream",
    "AttentionServer/ImportBlocks": "stream_unary",
}
Message = object  # a protobuf message, or raw bytes sent as they are
Case = tuple[str, str, list[Message], grpc.StatusCode]  # (service[@role], Method/case, request(s), status)

# Bytes that are no protobuf message, whatever the method: (case, bytes)
WIRE = [
    ("garbage", b"\xff\xff\xff\xff\xff"),
    ("surrogate_in_a_string", b"\x0a\x03\xed\xa0\x80"),  # field 1, a lone UTF-16 surrogate encoded as UTF-8
    ("invalid_utf8_string", b"\x0a\x02\xc3\x28"),
    ("truncated_varint", b"\x10\xff"),
    ("length_past_the_end", b"\x0a\x10abc"),
    ("field_number_zero", b"\x00\x01"),
    ("end_group_without_start", b"\x0c"),
]


def _generate(**fields) -> gpb.GenerateRequest:
    """A GenerateRequest: text "hello", greedy, 2 tokens, unless ``fields`` say otherwise (``sampling`` is a
    dict of SamplingParams fields merged into those)."""
    sampling = {"max_tokens": 2, "temperature": 0.0, **fields.pop("sampling", {})}
    if "token_ids" in fields:
        fields["token_ids"] = gpb.TokenIds(ids=fields["token_ids"])
    elif "text" not in fields:
        fields["text"] = "hello"
    return gpb.GenerateRequest(sampling=gpb.SamplingParams(**sampling), **fields)


def _s(**sampling) -> gpb.GenerateRequest:
    return _generate(sampling=sampling)


# Generation requests both the router and a compute instance must refuse: (case, request, code)
BAD_GENERATE = [
    ("no_prompt", gpb.GenerateRequest(sampling=gpb.SamplingParams(max_tokens=2)), INVALID),
    ("empty_text", _generate(text=""), INVALID),
    ("empty_token_ids", _generate(token_ids=[]), INVALID),
    ("token_id_past_the_vocabulary", _generate(token_ids=[1, 49152]), INVALID),
    ("negative_token_id", _generate(token_ids=[-1]), INVALID),
    ("max_tokens_zero", _s(max_tokens=0), INVALID),
    ("max_tokens_negative", _s(max_tokens=-5), INVALID),
    ("max_tokens_past_the_context", _s(max_tokens=9000), INVALID),
    ("temperature_negative", _s(temperature=-1.0), INVALID),
    ("temperature_nan", _s(temperature=float("nan")), INVALID),
    ("temperature_inf", _s(temperature=float("inf")), INVALID),
    ("top_p_zero", _s(top_p=0.0), INVALID),
    ("top_p_over_one", _s(top_p=1.5), INVALID),
    ("top_p_nan", _s(top_p=float("nan")), INVALID),
    ("top_k_zero", _s(top_k=0), INVALID),
    ("top_k_negative", _s(top_k=-3), INVALID),
    ("logprobs_over_20", _s(logprobs=21), INVALID),
    ("logprobs_negative", _s(logprobs=-1), INVALID),
    ("prompt_logprobs_over_20", _s(prompt_logprobs=21), INVALID),
    ("presence_penalty_over_2", _s(presence_penalty=3.0), INVALID),
    ("frequency_penalty_under_minus_2", _s(frequency_penalty=-3.0), INVALID),
    ("frequency_penalty_nan", _s(frequency_penalty=float("nan")), INVALID),
    ("repetition_penalty_zero", _s(repetition_penalty=0.0), INVALID),
    ("logit_bias_token_past_the_vocabulary", _s(logit_bias={10**6: 1.0}), INVALID),
    ("logit_bias_value_over_100", _s(logit_bias={5: 101.0}), INVALID),
    ("logit_bias_nan", _s(logit_bias={5: float("nan")}), INVALID),
    ("stop_token_id_negative", _s(stop_token_ids=[-3]), INVALID),
    ("stop_token_id_past_the_vocabulary", _s(stop_token_ids=[2, 99999999]), INVALID),
    ("min_tokens_negative", _s(min_tokens=-1), INVALID),
    ("json_schema_not_json", _s(json_schema="{not json"), INVALID),
    ("json_schema_not_a_schema", _s(json_schema='{"type": 5}'), INVALID),
    ("request_id_with_slash", _generate(request_id="tenant/req"), INVALID),
    ("request_id_2MB", _generate(request_id=LONG_ID), INVALID),
    ("request_id_with_newline", _generate(request_id="req\n1"), INVALID),
]


def _router_cases() -> list[Case]:
    cases = [(f"Generate/{n}", [r], c) for n, r, c in BAD_GENERATE]
    cases += [
        ("GenerateStream/max_tokens_zero", [_s(max_tokens=0)], INVALID),
        ("GenerateStream/no_prompt", [BAD_GENERATE[0][1]], INVALID),
        ("Generate/unknown_model", [_generate(model="gpt-17")], NOT_FOUND),
        ("Abort/request_id_2MB", [gpb.AbortRequest(request_id=LONG_ID)], INVALID),
        ("Tokenize/unknown_model", [rpb.TokenizeRequest(text="hi", model="gpt-17")], NOT_FOUND),
        ("Tokenize/surrogate", [b"\x0a\x03\xed\xa0\x80"], INVALID),
    ]  # fmt: skip
    cases += [(f"Generate/wire_{n}", [b], INVALID) for n, b in WIRE]
    cases += [(f"GenerateStream/wire_{n}", [b], INVALID) for n, b in WIRE[:2]]
    cases += [(f"Tokenize/wire_{n}", [b], INVALID) for n, b in WIRE[3:5]]
    return [("Router", *c) for c in cases]


def _compute_cases() -> list[Case]:
    cases = [(f"Generate/{n}", [r], c) for n, r, c in BAD_GENERATE]
    cases += [(f"Generate/wire_{n}", [b], INVALID) for n, b in WIRE]
    cases += [(f"Abort/wire_{n}", [b], INVALID) for n, b in WIRE[:2]]
    return [("ComputeInstance", *c) for c in cases]


def _place(**fields) -> Message:
    return mpb.PlaceRequest(**{"seq_id": "malformed", "num_blocks": 1, "block_size": 16, **fields})


def _register_compute(**fields) -> Message:
    return mpb.RegisterComputeRequest(**{"instance_id": "x", "address": "127.0.0.1:9", **fields})


def _register(**fields) -> Message:
    request = {"server_id": "rogue", "address": "127.0.0.1:9", "capacity_blocks": 4, "block_size": 16, **fields}
    return mpb.RegisterRequest(**request)


def _manager_cases() -> list[Case]:
    cases = [
        ("Place/num_blocks_zero", [_place(num_blocks=0)], INVALID),
        ("Place/num_blocks_negative", [_place(num_blocks=-4)], INVALID),
        ("Place/num_blocks_past_the_cluster", [_place(num_blocks=10**6)], EXHAUSTED),
        ("Place/seq_id_empty", [_place(seq_id="")], INVALID),
        ("Place/seq_id_with_slash", [_place(seq_id="a/b")], INVALID),
        ("Place/seq_id_2MB", [_place(seq_id=LONG_ID)], INVALID),
        ("Place/seq_id_with_newline", [_place(seq_id="a\nb")], INVALID),
        ("Place/other_block_size", [_place(block_size=7)], PRECONDITION),
        ("Place/first_block_index_negative", [_place(first_block_index=-1)], INVALID),
        ("Place/near_server_id_with_slash", [_place(near_server_id="a/b")], INVALID),
        ("Place/instance_id_with_slash", [_place(instance_id="a/b")], INVALID),
        ("Release/seq_id_empty", [mpb.ReleaseRequest()], INVALID),
        ("Release/seq_id_with_slash", [mpb.ReleaseRequest(seq_id="a/b")], INVALID),
        ("Release/never_placed", [mpb.ReleaseRequest(seq_id="never-placed")], NOT_FOUND),
        ("RegisterCompute/instance_id_empty", [_register_compute(instance_id="")], INVALID),
        ("RegisterCompute/instance_id_with_slash", [_register_compute(instance_id="a/b")], INVALID),
        ("RegisterCompute/address_without_port", [_register_compute(address="127.0.0.1")], INVALID),
        ("RegisterCompute/address_port_zero", [_register_compute(address="127.0.0.1:0")], INVALID),
        ("RegisterCompute/address_port_70000", [_register_compute(address="h:70000")], INVALID),
        ("RegisterCompute/address_with_space", [_register_compute(address="h ost:80")], INVALID),
        ("RegisterCompute/home_id_with_slash", [_register_compute(home_server_ids=["a/b"])], INVALID),
        ("RegisterCompute/node_name_with_newline", [_register_compute(node_name="n\n")], INVALID),
        ("HeartbeatCompute/unknown", [mpb.HeartbeatComputeRequest(instance_id="ghost")], NOT_FOUND),
        ("HeartbeatCompute/id_with_slash", [mpb.HeartbeatComputeRequest(instance_id="a/b")], INVALID),
        ("DeregisterCompute/unknown", [mpb.DeregisterComputeRequest(instance_id="ghost")], NOT_FOUND),
        ("DeregisterCompute/id_empty", [mpb.DeregisterComputeRequest()], INVALID),
    ]  # fmt: skip
    attention = [
        ("Register/server_id_with_slash", [_register(server_id="a/b")], INVALID),
        ("Register/server_id_empty", [_register(server_id="")], INVALID),
        ("Register/capacity_negative", [_register(capacity_blocks=-1)], INVALID),
        ("Register/block_size_zero", [_register(block_size=0)], INVALID),
        ("Register/other_block_size", [_register(block_size=7)], PRECONDITION),
        ("Register/address_without_port", [_register(address="nowhere")], INVALID),
        ("Heartbeat/unknown", [mpb.HeartbeatRequest(server_id="ghost")], NOT_FOUND),
        ("Heartbeat/server_id_with_slash", [mpb.HeartbeatRequest(server_id="a/b")], INVALID),
    ]  # fmt: skip
    cases += [(f"Place/wire_{n}", [b], INVALID) for n, b in WIRE]
    cases += [(f"Release/wire_{n}", [b], INVALID) for n, b in WIRE[:2]]
    return [("GlobalManager", *c) for c in cases] + [("GlobalManager@attention", *c) for c in attention]


def _seq(**fields) -> apb.StepSeq:
    return apb.StepSeq(**{"seq_id": "nope", "num_computed_tokens": 0, "num_new": 1, **fields})


def _open(**fields) -> Message:
    fields.setdefault("seqs", [_seq()])
    return apb.AttendStreamRequest(open=apb.StepOpen(**{"step_id": 1, "num_heads": 9, **fields}))


def _header(**fields) -> Message:
    header = {"seq_id": "imported", "payload": tpb.Tensor(dtype="float32", shape=[2, 30, 1, 16, 3, 64]), **fields}
    header.setdefault("block_indices", [0])
    return apb.BlockTransferChunk(header=apb.BlockTransferHeader(**header))


def _attention_cases() -> list[Case]:
    layer = apb.AttendStreamRequest(layer=apb.LayerInput(layer=0))
    data = apb.BlockTransferChunk(data=b"\0" * 8)

    def reserve(**f) -> list[Message]:
        return [apb.ReserveBlocksRequest(**{"seq_id": "malformed", "num_blocks": 1, **f})]

    cases = [
        ("ReserveBlocks/num_blocks_zero", reserve(num_blocks=0), INVALID),
        ("ReserveBlocks/num_blocks_negative", reserve(num_blocks=-2), INVALID),
        ("ReserveBlocks/num_blocks_past_the_pool", reserve(num_blocks=10**6), EXHAUSTED),
        ("ReserveBlocks/seq_id_empty", reserve(seq_id=""), INVALID),
        ("ReserveBlocks/seq_id_with_slash", reserve(seq_id="a/b"), INVALID),
        ("ReserveBlocks/seq_id_2MB", reserve(seq_id=LONG_ID), INVALID),
        ("CommitBlocks/unknown_reservation", [apb.CommitBlocksRequest(reservation_id=987654)], NOT_FOUND),
        ("CancelReservation/unknown_reservation", [apb.CancelReservationRequest(reservation_id=987654)], NOT_FOUND),
        ("FreeSequence/seq_id_with_slash", [apb.FreeSequenceRequest(seq_id="a/b")], INVALID),
        ("FreeSequence/seq_id_empty", [apb.FreeSequenceRequest()], INVALID),
        ("FreeSequence/from_block_index_negative", [apb.FreeSequenceRequest(seq_id="a", from_block_index=-1)], INVALID),
        (
            "FreeSequence/indices_and_from_block_index",
            [apb.FreeSequenceRequest(seq_id="a", block_indices=[0], from_block_index=0)],
            INVALID,
        ),
        ("ExportBlocks/unknown_sequence", [apb.ExportBlocksRequest(seq_id="nope")], NOT_FOUND),
        ("ExportBlocks/chunk_bytes_negative", [apb.ExportBlocksRequest(seq_id="nope", chunk_bytes=-1)], INVALID),
        ("ExportBlocks/chunk_bytes_1GB", [apb.ExportBlocksRequest(seq_id="nope", chunk_bytes=1 << 30)], INVALID),
        ("ExportBlocks/seq_id_with_slash", [apb.ExportBlocksRequest(seq_id="a/b")], INVALID),
        ("AttendStream/empty", [], INVALID),
        ("AttendStream/layer_before_open", [layer], INVALID),
        ("AttendStream/num_heads_zero", [_open(num_heads=0)], INVALID),
        ("AttendStream/num_heads_negative", [_open(num_heads=-9)], INVALID),
        ("AttendStream/unknown_sequence", [_open(), layer], NOT_FOUND),
        ("AttendStream/seq_id_with_slash", [_open(seqs=[_seq(seq_id="a/b")])], INVALID),
        ("AttendStream/num_new_zero", [_open(seqs=[_seq(num_new=0)])], INVALID),
        ("AttendStream/num_computed_negative", [_open(seqs=[_seq(num_computed_tokens=-3)])], INVALID),
        ("AttendStream/tensor_channel_on_a_grpc_server", [_open(tensor_channel="c1", num_kv_rows=1)], PRECONDITION),
        ("ImportBlocks/empty", [], INVALID),
        ("ImportBlocks/data_before_header", [data], INVALID),
        ("ImportBlocks/unknown_dtype", [_header(payload=tpb.Tensor(dtype="complex7", shape=[1]))], INVALID),
        ("ImportBlocks/payload_of_rank_3", [_header(payload=tpb.Tensor(dtype="float32", shape=[2, 30, 1]))], INVALID),
        ("ImportBlocks/indices_do_not_match", [_header(block_indices=[0, 1])], INVALID),
        ("ImportBlocks/unknown_reservation", [_header(reservation_id=987654)], NOT_FOUND),
        ("OpenTensorChannel/on_a_grpc_server", [apb.OpenTensorChannelRequest(channel_id="c1")], PRECONDITION),
        ("CloseTensorChannel/on_a_grpc_server", [apb.CloseTensorChannelRequest(channel_id="c1")], PRECONDITION),
    ]  # fmt: skip
    cases += [(f"ReserveBlocks/wire_{n}", [b], INVALID) for n, b in WIRE]
    cases += [(f"AttendStream/wire_{n}", [b], INVALID) for n, b in WIRE[:2]]
    cases += [(f"ImportBlocks/wire_{n}", [b], INVALID) for n, b in WIRE[:2]]
    return [("AttentionServer", *c) for c in cases]


CASES = _router_cases() + _compute_cases() + _manager_cases() + _attention_cases()


def _address(mesh, service: str) -> str:
    return {
        "Router": mesh.router_address,
        "ComputeInstance": mesh.compute_instances()[0].address,
        "GlobalManager": mesh.manager_address,
        "AttentionServer": mesh.attention_servers()[0].address,
    }[service]


def _status(mesh, service: str, case: str, payload: list[Message]) -> grpc.StatusCode:
    """Send ``payload`` (one request, or a stream's requests; messages serialized, bytes as they are) to
    the method ``case`` names, with the role that may call it; returns the call's status."""
    name, _, role = service.partition("@")
    method = case.split("/")[0]
    kind = KIND.get(f"{name}/{method}", "unary_unary")
    wire = [m if isinstance(m, bytes) else m.SerializeToString() for m in payload]
    with mesh_channel(_address(mesh, name), role or ROLE[name]) as ch:
        call = getattr(ch, kind)(f"/infinite_llm.v1.{name}/{method}")
        try:
            replies = call(iter(wire) if kind.startswith("stream") else wire[0], timeout=15)
            if kind.endswith("stream"):
                list(replies)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["Router", "ComputeInstance", "GlobalManager", "AttentionServer"])
def test_at_least_30_kinds_of_malformed_input_per_service(service):
    assert len({c[1] for c in CASES if c[0].partition("@")[0] == service}) >= 30


@pytest.mark.parametrize("service,case,payload,code", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_malformed_input_gets_its_exact_status(mesh, service, case, payload, code):
    assert _status(mesh, service, case, payload) == code


@pytest.fixture(scope="module")
def reference(make_engine) -> list[int]:
    """The greedy tokens of the correct request, from the single-process engine."""
    engine = make_engine(num_kv_blocks=64)
    return engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("service", ["Router", "ComputeInstance", "GlobalManager", "AttentionServer"])
def test_after_the_malformed_input_every_service_is_healthy_serves_correctly_and_leaked_nothing(
    mesh, reference, service
):
    role = {"GlobalManager": "client"}.get(service, ROLE[service])
    with mesh_channel(_address(mesh, service), role) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with Client(mesh.router_address) as c:
        assert c.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids == reference
    assert wait_until(lambda: all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger)
    assert "rogue" not in {s.server_id for s in cluster_state(mesh.manager_address).servers}
