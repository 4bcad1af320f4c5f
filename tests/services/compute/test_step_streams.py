"""One long-lived AttendStream per attention server: steps follow each other on it (StepEnd between them), so a
step starts no thread and opens no call. Real attention servers on loopback, every partial checked against a
local mirror and dense attention (``Steps``); a server of the older one-step-a-stream kind still works; a
failed step's streams are replaced; a stopping server ends its idle streams at once."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from infinite_llm.core.dist_attention import HolderId, LayerInput
from infinite_llm.core.errors import NotFound, Unavailable
from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.services.attention.servicer import AttentionServicer, _seq_step
from tests.services.attention.helpers import Pair, Steps

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
NUM_HEADS = 4


def _decode(steps: Steps, first: int, count: int) -> None:
    """``count`` decode steps of "a" and "b" (placed by ``_two_sequences``) from position ``first``."""
    for i in range(count):
        steps.step([SeqStep("a", first + i, 1), SeqStep("b", first - 2 + i, 1)])


def _two_sequences(make_server) -> tuple[Steps, dict[str, object]]:  # noqa: ANN001
    """Two real servers, "a" and "b" spread over both and prefilled; returns the steps and the servers."""
    servers, pairs = {}, {}
    for sid in ("A", "B"):
        servers[sid], stub = make_server(16, LAYOUT, sid)
        pairs[sid] = Pair(stub, 16, LAYOUT, address=servers[sid].address)
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    steps.place("a", ["A", "B", "A", "B"])  # up to 16 tokens, both servers
    steps.place("b", ["B", "A", "B"])  # up to 12
    steps.step([SeqStep("a", 0, 6), SeqStep("b", 0, 4)])
    return steps, servers


def test_steps_reuse_one_stream_per_server_and_start_no_thread(make_server, monkeypatch):
    steps, servers = _two_sequences(make_server)
    _decode(steps, 6, 1)
    transport = steps.transport.remote
    assert transport.num_streams_opened == 2  # the prefill's two streams carried the first decode too
    started = []
    original = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        original(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    _decode(steps, 7, 4)  # each partial checked against the mirrors and dense attention
    monkeypatch.undo()
    assert (transport.num_streams_opened, started) == (2, [])


async def _one_step_a_stream(self, request_iterator, context):  # noqa: ANN001, ANN202
    """AttendStream as servers served it before StepEnd: one step, no metadata, done at the half-close."""
    stream = aiter(request_iterator)
    first = await anext(stream)
    step, small = await self._run(self._open_step, [_seq_step(s) for s in first.open.seqs], first.open.num_heads)
    async for msg in stream:
        if msg.WhichOneof("part") != "layer":
            raise AssertionError(f"a one-step server got {msg.WhichOneof('part')}")
        yield await self._attend(step, small, msg.layer)


def test_a_server_that_takes_one_step_a_stream_gets_a_stream_a_step(make_server, monkeypatch):
    monkeypatch.setattr(AttentionServicer, "AttendStream", _one_step_a_stream)  # before the servers start
    steps, servers = _two_sequences(make_server)
    _decode(steps, 6, 3)  # the same partials as from the mirrors
    assert steps.transport.remote.num_streams_opened == 2 * 4


def test_a_failed_step_replaces_its_streams_and_the_next_step_is_right(make_server):
    steps, _ = _two_sequences(make_server)
    transport = steps.transport.remote
    a = HolderId("A")
    transport.open_step(10_000, {a: [SeqStep("zzz", 4, 1)]}, NUM_HEADS)  # a sequence server A does not hold
    x = LayerInput(torch.zeros(1, NUM_HEADS, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))
    with pytest.raises(NotFound, match="zzz"):
        transport.attend(10_000, 0, {a: x})
    transport.close_step(10_000, failed=True)
    _decode(steps, 6, 2)
    assert transport.num_streams_opened == 3  # A's failed stream replaced once, B's kept


def test_a_stopping_server_ends_its_idle_streams_at_once(make_server, loop):
    steps, servers = _two_sequences(make_server)
    transport = steps.transport.remote
    idle = transport._idle[HolderId("A")].call
    start = time.monotonic()
    loop.run(servers["A"].stop(5.0))
    assert time.monotonic() - start < 2.5  # not the 5 s grace an idle stream would have held it
    assert idle.code() == grpc.StatusCode.OK
    with pytest.raises(Unavailable):  # the next step finds A gone, through a new call
        _decode(steps, 6, 1)
    assert transport.num_streams_opened == 3
