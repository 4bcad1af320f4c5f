"""The torch.distributed transport over real attention servers on loopback (gloo): the same partials as
the gRPC transport, bit for bit; a ``--transport grpc`` server makes it fall back (logged once); a bad
layer on a channel is the same typed error and the next step on the pair is right."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

from infinite_llm.core.errors import InvalidRequest, Unavailable
from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.services.compute.stall_watch import StallWatch
from infinite_llm.services.compute.torch_transport import TorchTransport
from tests.services.attention.helpers import TIMEOUT, Pair, Steps

NUM_HEADS = 4
STEPS = [  # "a": 13 tokens over A,B,A,B; "b": 9 over B,A,B (block_size 4): prefill, then decodes crossing blocks
    [SeqStep("a", 0, 10), SeqStep("b", 0, 6)],
    *([SeqStep("a", 10 + i, 1), SeqStep("b", 6 + i, 1)] for i in range(3)),
]


def _steps(make_server, layout, server_transport: str, torch_transport: bool) -> Steps:
    servers = {sid: make_server(12, layout, sid, server_transport) for sid in ("A", "B")}
    pairs = {sid: Pair(stub, 12, layout, address=server.address) for sid, (server, stub) in servers.items()}
    steps = Steps(pairs, layout, NUM_HEADS)
    steps.servicers = [server.servicer for server, _ in servers.values()]
    if torch_transport:
        steps.transport.remote = TorchTransport(lambda s: pairs[s].address, timeout_s=TIMEOUT)
    steps.place("a", ["A", "B", "A", "B"])
    steps.place("b", ["B", "A", "B"])
    return steps


def _run(steps: Steps) -> list[dict]:
    """Every step of ``STEPS``: the servers' partials per layer (also checked against mirrors and dense)."""
    return [steps.step(seqs) for seqs in STEPS]


def _assert_same_partials(got: list[dict], want: list[dict]) -> None:
    for step_got, step_want in zip(got, want, strict=True):
        for layer, partials in step_want.items():
            for server, (out, lse) in partials.items():
                assert torch.equal(step_got[layer][server][0], out) and torch.equal(step_got[layer][server][1], lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_transport_gives_the_grpc_partials_bit_for_bit_over_two_servers(make_server, dtype):
    layout = KVLayout(3, 4, 2, 8, dtype)
    want = _run(_steps(make_server, layout, "torch", torch_transport=False))
    steps = _steps(make_server, layout, "torch", torch_transport=True)
    got = _run(steps)
    _assert_same_partials(got, want)
    transport = steps.transport.remote
    assert transport.fallbacks == {} and set(transport._channels) == {"A", "B"}
    assert [len(s.channels) for s in steps.servicers] == [1, 1]  # one channel per pair, reused by every step
    assert transport.num_streams_opened == 2  # and one AttendStream per pair: channel steps end with StepEnd
    transport.close()


def test_a_grpc_only_server_makes_the_pair_fall_back_to_grpc_and_the_reason_is_logged_once(make_server, caplog):
    layout = KVLayout(3, 4, 2, 8)
    want = _run(_steps(make_server, layout, "grpc", torch_transport=False))
    steps = _steps(make_server, layout, "grpc", torch_transport=True)
    with caplog.at_level(logging.WARNING, logger="infinite_llm.services.compute.torch_transport"):
        got = _run(steps)
    _assert_same_partials(got, want)
    transport = steps.transport.remote
    assert set(transport.fallbacks) == {"A", "B"} and transport._channels == {}
    assert all("FAILED_PRECONDITION" in why and "--transport grpc" in why for _, why in transport.fallbacks.values())
    logged = [r.getMessage() for r in caplog.records if "tensors travel over gRPC" in r.getMessage()]
    assert sorted(m.split()[2] for m in logged) == ["A", "B"]  # once per server over 4 steps


def test_open_tensor_channel_on_a_grpc_only_server_is_failed_precondition(make_server):
    _, stub = make_server(4, KVLayout(3, 4, 2, 8))
    request = pb.OpenTensorChannelRequest(channel_id="c", store_host="127.0.0.1", store_port=1, backend="gloo")
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenTensorChannel(request, timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--transport grpc" in info.value.details()


@pytest.mark.parametrize(
    "case, num_heads, details",
    [
        ("nan_query_after_its_bytes_arrived", NUM_HEADS, "query holds NaN"),
        ("bad_opening_before_any_bytes_arrived", 3, "num_heads 3 is not a positive multiple of 2"),
    ],
)
def test_a_bad_layer_on_a_channel_is_invalid_argument_and_the_next_step_on_the_pair_is_right(
    make_server, case, num_heads, details
):
    layout = KVLayout(3, 4, 2, 8)
    steps = _steps(make_server, layout, "torch", torch_transport=True)
    steps.step(STEPS[0])
    transport = steps.transport.remote
    before = {s: c.channel_id for s, c in transport._channels.items()}
    t = sum(s.num_new for s in STEPS[1])
    q = torch.randn(t, num_heads, 8)
    q[0, 0, 0] = float("nan")
    k, v = torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    with pytest.raises(InvalidRequest, match=details), steps.dist.prepare(STEPS[1], num_heads) as attention:
        attention(0, q, k, v)
    assert transport._channels == {}  # the failed step's channels were retired
    for seqs in STEPS[1:]:  # nothing was written: the same step again, right (mirror and dense checks)
        steps.step(seqs)
    after = {s: c.channel_id for s, c in transport._channels.items()}
    assert set(after) == {"A", "B"} and not set(after.values()) & set(before.values())
    deadline = time.monotonic() + 5
    while any(len(s.channels) != 1 for s in steps.servicers) and time.monotonic() < deadline:
        time.sleep(0.05)  # the retired channels close in the background
    assert [len(s.channels) for s in steps.servicers] == [1, 1]
    transport.close()


def test_forty_good_steps_keep_each_pairs_channel_open(make_server):
    """A good step's stream must end on its own: a dropped call is a cancel, which would close the channel
    under a server still finishing the step (the next step then fails and recomputes)."""
    layout = KVLayout(3, 4, 2, 8)
    servers = {sid: make_server(12, layout, sid, "torch") for sid in ("A", "B")}
    pairs = {sid: Pair(stub, 12, layout, address=server.address) for sid, (server, stub) in servers.items()}
    steps = Steps(pairs, layout, NUM_HEADS)
    steps.servicers = [server.servicer for server, _ in servers.values()]
    transport = steps.transport.remote = TorchTransport(lambda s: pairs[s].address, timeout_s=TIMEOUT)
    steps.place("c", ["A", "B"] * 6)  # 12 rBlocks: 48 tokens
    steps.step([SeqStep("c", 0, 4)])  # the first step travels inline (the dtype is learnt from it)
    steps.step([SeqStep("c", 4, 1)])
    opened = {s: c.channel_id for s, c in transport._channels.items()}
    for n in range(5, 45):  # 40 decode steps over every rBlock of "c"
        steps.step([SeqStep("c", n, 1)])
    assert {s: c.channel_id for s, c in transport._channels.items()} == opened and set(opened) == {"A", "B"}
    assert [len(s.channels) for s in steps.servicers] == [1, 1]
    transport.close()


def test_a_channel_step_in_another_dtype_than_the_layout_is_invalid_argument_not_a_hang(make_server):
    layout = KVLayout(3, 4, 2, 8)  # fp32 servers
    steps = _steps(make_server, layout, "torch", torch_transport=True)
    steps.step(STEPS[0])
    transport = steps.transport.remote
    transport.dtype = "bfloat16"  # a compute instance whose model runs in bf16
    t = sum(s.num_new for s in STEPS[1])
    q, k, v = (torch.randn(t, h, 8, dtype=torch.bfloat16) for h in (NUM_HEADS, 2, 2))
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="query is torch.bfloat16"), steps.dist.prepare(STEPS[1], NUM_HEADS) as a:
        a(0, q, k, v)
    assert time.monotonic() - started < 5  # refused at once (the channels' timeout is 30 s)
    transport.close()


def test_a_server_that_stops_answering_on_its_channel_is_unavailable_within_the_stall_limit(make_server):
    """A paused server (here: one whose attention hangs) is given up on at the stall limit, not at the
    channel's 30 s timeout; the failed step closes the channel."""
    layout = KVLayout(3, 4, 2, 8)
    steps = _steps(make_server, layout, "torch", torch_transport=True)
    steps.step(STEPS[0])
    transport = steps.transport.remote
    transport.stall = StallWatch(min_s=0.5)
    hung = threading.Event()
    holder = steps.servicers[1].holder  # server B
    real = holder.attend_layer

    def hang(*args):  # noqa: ANN002, ANN202
        hung.wait(10)
        return real(*args)

    holder.attend_layer = hang
    t = sum(s.num_new for s in STEPS[1])
    q, k, v = torch.randn(t, NUM_HEADS, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="attention server B"), steps.dist.prepare(STEPS[1], NUM_HEADS) as a:
        a(0, q, k, v)
    assert 0.4 < time.monotonic() - started < 3
    assert transport._channels == {}  # the failed step's channels were retired
    hung.set()
    transport.close()
