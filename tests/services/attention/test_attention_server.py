"""AttentionServer over real loopback gRPC: placement, AttendStream vs local RManagers and dense attention,
stats, bad input with exact status codes, health, reflection, request ids, config."""

import asyncio
import queue
import socket
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from infinite_llm.core.config import ModelConfig
from infinite_llm.core.dist_attention import LayerInput
from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.rpc import codec
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.interceptors import REQUEST_ID_KEY
from infinite_llm.rpc.options import STEPS_PER_STREAM_KEY, STEPS_PER_STREAM_MANY
from infinite_llm.services.attention import AttentionServerConfig, serve
from infinite_llm.services.compute.grpc_transport import layer_message, step_end, step_open
from tests.services.attention.helpers import TIMEOUT, Steps

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)  # 1536 B per rBlock
NUM_HEADS = 4
SERVICE = "infinite_llm.v1.AttentionServer"


def _stats(stub) -> tuple[int, int, int, int, int]:
    s = stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    return s.num_free, s.num_used, s.num_reserved, s.num_sequences, s.used_bytes


def _code(call, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=TIMEOUT)
    return info.value.code()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_then_decode_over_two_servers_matches_local_rmanagers_and_dense_attention(make_pair, dtype):
    layout = KVLayout(3, 4, 2, 8, dtype)
    pairs = {sid: make_pair(12, layout, sid) for sid in ("A", "B")}
    steps = Steps(pairs, layout, NUM_HEADS)
    steps.place("a", ["A", "B", "A", "B"])  # 13 tokens
    steps.place("b", ["B", "A", "B"])  # 9 tokens
    steps.step([SeqStep("a", 0, 10), SeqStep("b", 0, 6)])
    for i in range(3):
        steps.step([SeqStep("a", 10 + i, 1), SeqStep("b", 6 + i, 1)])


def test_a_server_holding_no_block_of_a_query_position_returns_lse_minus_inf(make_pair):
    pairs = {sid: make_pair(4, LAYOUT, sid) for sid in ("A", "B")}
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    steps.place("a", ["A", "B"])
    out, lse = steps.step([SeqStep("a", 0, 6)])[0]["B"]
    assert torch.isinf(lse[:4]).all() and (lse[:4] < 0).all() and torch.isfinite(lse[4:]).all()
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))


def test_a_layer_message_does_not_grow_with_the_context():
    """The bytes one sequence adds to a layer's message are the same at 1K and at 64K tokens of context."""
    q, k = torch.zeros(1, 32, 128), torch.zeros(1, 8, 128)
    layer = layer_message(5, LayerInput(q, k, k))
    sizes = [(step_open(1, [SeqStep("s", ctx - 1, 1)], 32).ByteSize(), layer.ByteSize()) for ctx in (1024, 65536)]
    assert sizes[0][1] == sizes[1][1] == layer.ByteSize()
    assert sizes[1][0] - sizes[0][0] <= 2  # the step's opening: one varint grows by at most 2 bytes


def test_stats_count_blocks_exactly_and_free_returns_to_baseline(make_server):
    _, stub = make_server(10, LAYOUT)
    s = stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    assert (s.server_id, s.num_blocks, s.bytes_per_block, s.capacity_bytes) == ("attn-0", 10, 1536, 15360)
    assert (s.layout.num_layers, s.layout.block_size, s.layout.num_kv_heads, s.layout.head_dim) == (3, 4, 2, 8)
    assert s.layout.dtype == "float32" and _stats(stub) == (10, 0, 0, 0, 0)
    r = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="a", num_blocks=3), timeout=TIMEOUT)
    assert list(r.block_ids) == [0, 1, 2] and _stats(stub) == (7, 0, 3, 0, 0)
    commit = pb.CommitBlocksRequest(reservation_id=r.reservation_id, block_indices=[0, 1, 2])
    stub.CommitBlocks(commit, timeout=TIMEOUT)
    assert _stats(stub) == (7, 3, 0, 1, 3 * 1536)
    r2 = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="b", num_blocks=2), timeout=TIMEOUT)
    stub.CancelReservation(pb.CancelReservationRequest(reservation_id=r2.reservation_id), timeout=TIMEOUT)
    assert _stats(stub) == (7, 3, 0, 1, 3 * 1536)
    stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="a", num_blocks=1), timeout=TIMEOUT)  # left open
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="a"), timeout=TIMEOUT).num_freed == 3
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="never"), timeout=TIMEOUT).num_freed == 0
    assert _stats(stub) == (10, 0, 0, 0, 0)


def test_free_from_a_block_index_keeps_the_lower_blocks_and_reports_what_is_held(make_server):
    """FreeSequence(from_block_index): what the manager uses to redo a Place whose reply was lost."""
    _, stub = make_server(10, LAYOUT)
    r = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="a", num_blocks=4), timeout=TIMEOUT)
    stub.CommitBlocks(pb.CommitBlocksRequest(reservation_id=r.reservation_id, block_indices=[0, 1, 5, 6]))
    open_r = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="a", num_blocks=1), timeout=TIMEOUT)
    reply = stub.FreeSequence(pb.FreeSequenceRequest(seq_id="a", from_block_index=2), timeout=TIMEOUT)
    assert (reply.num_freed, reply.num_held) == (2, 2)
    assert _stats(stub) == (7, 2, 1, 1, 2 * 1536)  # the open reservation stays
    reply = stub.FreeSequence(pb.FreeSequenceRequest(seq_id="a", from_block_index=2), timeout=TIMEOUT)
    assert (reply.num_freed, reply.num_held) == (0, 2)  # again: nothing more
    # the freed logical indices can be committed again; the held ones cannot
    stub.CommitBlocks(pb.CommitBlocksRequest(reservation_id=open_r.reservation_id, block_indices=[5]))
    r = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="a", num_blocks=1), timeout=TIMEOUT)
    assert _code(stub.CommitBlocks, pb.CommitBlocksRequest(reservation_id=r.reservation_id, block_indices=[1])) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    reply = stub.FreeSequence(pb.FreeSequenceRequest(seq_id="a", from_block_index=0), timeout=TIMEOUT)
    assert (reply.num_freed, reply.num_held) == (3, 0)
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="a"), timeout=TIMEOUT).num_freed == 0
    assert _stats(stub) == (10, 0, 0, 0, 0)


@pytest.fixture
def prefilled(make_pair):
    """One server with sequence "a" (2 rBlocks) prefilled with 5 tokens, and a valid next decode step."""
    pair = make_pair(4, LAYOUT)
    steps = Steps({"A": pair}, LAYOUT, NUM_HEADS)
    steps.place("a", ["A", "A"])
    steps.step([SeqStep("a", 0, 5)])
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, NUM_HEADS, 8, generator=g), torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8)
    return pair, steps, (q, k, v)


def _decode_messages(qkv, layer=0) -> list[pb.AttendStreamRequest]:
    """A valid decode step of "a" at position 5: its opening and one layer."""
    return [step_open(7, [SeqStep("a", 5, 1)], NUM_HEADS), layer_message(layer, LayerInput(*qkv))]


def _bad_query(dtype=torch.float32, shape=(1, NUM_HEADS, 8), nan=False):
    def mutate(msgs):
        t = torch.randn(*shape).to(dtype)
        if nan:
            t[0, 0, 0] = float("nan")
        codec.encode_tensor(t, msgs[1].layer.query)

    return mutate


def _open(**fields):
    def mutate(msgs):
        for name, value in fields.items():
            if name == "seq":
                msgs[0].open.seqs[0].CopyFrom(pb.StepSeq(**value))
            else:
                setattr(msgs[0].open, name, value)

    return mutate


def _inf_key(msgs):
    codec.encode_tensor(torch.full((1, 2, 8), float("inf")), msgs[1].layer.key)


def _truncated_query(msgs):
    msgs[1].layer.query.data = msgs[1].layer.query.data[:-4]


def _layer(n):
    def mutate(msgs):
        msgs[1].layer.layer = n

    return mutate


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
BAD_STEPS = {  # case: (mutation of a valid decode step's messages, status code, part of the details)
    "nan_query": (_bad_query(nan=True), INVALID, "query holds NaN"),
    "inf_key": (_inf_key, INVALID, "key holds NaN or infinite"),
    "bf16_query_on_fp32_server": (_bad_query(dtype=torch.bfloat16), INVALID, "query is torch.bfloat16"),
    "wrong_head_dim": (_bad_query(shape=(1, NUM_HEADS, 7)), INVALID, "query is torch.float32 [1, 4, 7]"),
    "heads_not_multiple_of_kv_heads": (_open(num_heads=3), INVALID, "not a positive multiple of 2"),
    "bytes_do_not_match_shape": (_truncated_query, INVALID, "124 data bytes do not match shape [1, 4, 8]"),
    "unknown_sequence": (_open(seq={"seq_id": "zzz", "num_computed_tokens": 5, "num_new": 1}), NOT_FOUND, "'zzz'"),
    "layer_out_of_range": (_layer(3), INVALID, "layer 3 out of range"),
    "no_new_token": (_open(seq={"seq_id": "a", "num_computed_tokens": 5, "num_new": 0}), INVALID, "num_new 0"),
    "step_past_its_rblocks": (
        _open(seq={"seq_id": "a", "num_computed_tokens": 8, "num_new": 1}),
        INVALID,
        "key is torch.float32 [1, 2, 8], the step needs torch.float32 [0, 2, 8]",
    ),
    "missing_key": (lambda msgs: msgs[1].layer.ClearField("key"), INVALID, "unknown dtype"),
    "no_opening": (lambda msgs: msgs.pop(0), INVALID, "must start with a StepOpen"),
    "two_openings": (lambda msgs: msgs.insert(1, msgs[0]), INVALID, "exactly one StepOpen"),
    "end_of_another_step": (lambda msgs: msgs.append(step_end(8)), INVALID, "a StepEnd of step 8 in step 7"),
    "layer_after_the_end": (
        lambda msgs: msgs.extend([step_end(7), msgs[1]]),
        INVALID,
        "must start with a StepOpen, after the last StepEnd",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_steps_get_exact_codes_change_nothing_and_the_next_step_is_right(prefilled, case):
    pair, steps, qkv = prefilled
    mutate, code, details = BAD_STEPS[case]
    before = _stats(pair.stub)
    bad = _decode_messages(qkv)
    mutate(bad)
    with pytest.raises(grpc.RpcError) as info:
        list(pair.stub.AttendStream(iter(bad), timeout=TIMEOUT))
    assert info.value.code() == code and details in info.value.details()
    assert _stats(pair.stub) == before
    (good,) = list(pair.stub.AttendStream(iter(_decode_messages(qkv)), timeout=TIMEOUT))
    plan = pair.mirror.plan_step([SeqStep("a", 5, 1)])
    want, want_lse = pair.mirror.attend(0, plan, *qkv)
    assert torch.equal(codec.decode_tensor(good.partial_out), want)
    assert torch.equal(codec.decode_tensor(good.lse), want_lse)


def test_one_stream_carries_steps_one_after_another(prefilled):
    """StepOpen, layers, StepEnd, then the next step on the same stream: each step's partial equals its
    local plan's; the server says so in its initial metadata, and ends the stream OK at the half-close."""
    pair, _, qkv = prefilled
    g = torch.Generator().manual_seed(2)
    qkv2 = (torch.randn(1, NUM_HEADS, 8, generator=g), torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8))
    outbox = queue.SimpleQueue()
    call = pair.stub.AttendStream(iter(outbox.get, None), timeout=TIMEOUT)
    assert (STEPS_PER_STREAM_KEY, STEPS_PER_STREAM_MANY) in tuple(call.initial_metadata())
    got = []
    for step_id, (position, x) in enumerate([(5, qkv), (6, qkv2)], start=7):
        outbox.put(step_open(step_id, [SeqStep("a", position, 1)], NUM_HEADS))
        for layer in range(LAYOUT.num_layers):
            outbox.put(layer_message(layer, LayerInput(*x)))
            reply = next(call)
            assert reply.layer == layer
            got.append((codec.decode_tensor(reply.partial_out), codec.decode_tensor(reply.lse)))
        outbox.put(step_end(step_id))
    outbox.put(None)
    assert list(call) == [] and call.code() == grpc.StatusCode.OK
    for i, (position, x) in enumerate([(5, qkv), (6, qkv2)]):
        plan = pair.mirror.plan_step([SeqStep("a", position, 1)])
        for layer in range(LAYOUT.num_layers):
            want, want_lse = pair.mirror.attend(layer, plan, *x)
            out, lse = got[i * LAYOUT.num_layers + layer]
            assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_a_plan_freed_mid_step_is_refused_not_written(prefilled):
    """FreeSequence between two layers of a step: the next layer is NOT_FOUND, nothing lands in freed blocks."""
    pair, _, qkv = prefilled
    outbox = queue.SimpleQueue()
    outbox.put(step_open(9, [SeqStep("a", 5, 1)], NUM_HEADS))
    outbox.put(layer_message(0, LayerInput(*qkv)))
    replies = pair.stub.AttendStream(iter(outbox.get, None), timeout=TIMEOUT)
    assert next(replies).layer == 0
    pair.stub.FreeSequence(pb.FreeSequenceRequest(seq_id="a"), timeout=TIMEOUT)
    outbox.put(layer_message(1, LayerInput(*qkv)))
    with pytest.raises(grpc.RpcError) as info:
        next(replies)
    outbox.put(None)
    assert info.value.code() == NOT_FOUND and "freed during the step" in info.value.details()
    assert _stats(pair.stub) == (4, 0, 0, 0, 0)


def test_bad_placement_calls_get_exact_codes_and_change_nothing(prefilled):
    pair, _, _ = prefilled
    stub, before = pair.stub, _stats(pair.stub)
    assert _code(stub.ReserveBlocks, pb.ReserveBlocksRequest(seq_id="b", num_blocks=3)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert _code(stub.ReserveBlocks, pb.ReserveBlocksRequest(seq_id="b", num_blocks=0)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert _code(stub.CommitBlocks, pb.CommitBlocksRequest(reservation_id=99)) == grpc.StatusCode.NOT_FOUND
    assert _code(stub.CancelReservation, pb.CancelReservationRequest(reservation_id=99)) == grpc.StatusCode.NOT_FOUND
    assert _stats(stub) == before
    r = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="b", num_blocks=2), timeout=TIMEOUT)
    assert list(r.block_ids) == [2, 3]


def test_health_reflection_and_request_id_on_an_attention_server(make_server):
    server, stub = make_server(2, LAYOUT)
    with sync_channel(server.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        listing = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
        )
        assert SERVICE in {s.name for s in next(listing).list_services_response.service}
    _, call = stub.GetStats.with_call(pb.GetStatsRequest(), metadata=[(REQUEST_ID_KEY, "req-42")], timeout=TIMEOUT)
    assert dict(call.trailing_metadata())[REQUEST_ID_KEY] == "req-42"


def test_config_takes_the_layout_from_the_model_and_refuses_too_little_memory():
    model = ModelConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = AttentionServerConfig.for_model(model, server_id="s", kv_memory_bytes=1 << 20, block_size=4)
    assert config.layout == KVLayout(3, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"kv_memory 1.0KiB holds no rBlock: one takes 1.5KiB"):
        AttentionServerConfig.for_model(model, server_id="s", kv_memory_bytes=1024, block_size=4)
    with pytest.raises(ValueError, match="float64"):
        AttentionServerConfig.for_model(model, server_id="s", kv_memory_bytes=1 << 20, dtype="float64")


def _wait_for_port(port: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.01)
    raise TimeoutError(f"nothing listens on port {port}")


def test_serve_runs_until_stopped(loop):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = AttentionServerConfig(
        server_id="s", kv_memory_bytes=1 << 16, num_layers=1, num_kv_heads=1, head_dim=4, port=port, grace_s=0
    )
    stop = asyncio.Event()
    task = asyncio.run_coroutine_threadsafe(serve(config, stop), loop.loop)
    _wait_for_port(port)
    with sync_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    loop.loop.call_soon_threadsafe(stop.set)
    assert task.result(timeout=TIMEOUT) is None
