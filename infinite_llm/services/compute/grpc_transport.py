"""DistAttention's gRPC transport: one long-lived bidirectional ``AttendStream`` per attention server.

A step opens with a ``StepOpen`` (step id, and per sequence only ``seq_id``, ``num_computed_tokens``,
``num_new``: the server plans the step once from the rBlocks it recorded at commit), then carries one
``LayerInput`` (queries + the new K/V stored there) per layer, each answered by one ``LayerPartial``
(``partial_out`` + ``lse``), and ends with a ``StepEnd``; the same stream then carries the next step. A
layer's bytes depend on the step's new tokens only, never on the context (DESIGN.md §3). One stream per
server, not one per step: the blocking gRPC API starts a request-consumer thread for every call (and a
channel spin thread whenever a channel had none in flight), 2 threads per server per step that a 2-layer
model's step spent 6.4 ms of 27 on (2 CPU cores). A server that does not advertise StepEnd in its initial
metadata (an older build) gets a stream per step, half-closed at the step's end.

Deadlines: each step keeps its own (``timeout_s``, enforced here, since a stream outlives its steps), each
layer's reply has its own (``stall_watch``: seconds, from the server's recent pace), and each stream has
``STREAM_LIFETIME_S`` (it is given no step that could outlive it). An error ends the stream with its status,
which becomes the typed error here (``UNAVAILABLE``, a stalled server's too, makes the compute instance
recompute on the survivors); a failed step cancels its streams and the next step opens new ones.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.core.dist_attention import HolderId, LayerInput, Partial
from infinite_llm.core.errors import DeadlineExceeded, InfiniteLLMError, Unavailable
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.codec import decode_tensor, encode_tensor
from infinite_llm.rpc.options import STEPS_PER_STREAM_KEY, STEPS_PER_STREAM_MANY, STREAM_LIFETIME_S
from infinite_llm.services.compute.stall_watch import StallWatch

OnRpc = Callable[[str, float], None]


def step_open(
    step_id: int,
    seqs: list[SeqStep],
    num_heads: int,
    tensor_channel: str = "",
    num_kv_rows: int = 0,
    dtype: str = "",
) -> apb.AttendStreamRequest:
    """The first message of a step to one server (with the current trace context: the server's span of the
    step joins the caller's trace)."""
    trace_context: dict[str, str] = {}
    propagate.inject(trace_context)
    return apb.AttendStreamRequest(
        open=apb.StepOpen(
            step_id=step_id,
            num_heads=num_heads,
            tensor_channel=tensor_channel,
            num_kv_rows=num_kv_rows,
            dtype=dtype,
            trace_context=trace_context,
            seqs=[
                apb.StepSeq(
                    seq_id=s.seq_id,
                    num_computed_tokens=s.num_computed_tokens,
                    num_new=s.num_new,
                    num_blocks_here=s.num_blocks_here,
                )
                for s in seqs
            ],
        )
    )


def layer_message(layer: int, x: LayerInput | None) -> apb.AttendStreamRequest:
    """One layer's message: ``x``'s tensors inline (``None``: they travel on a tensor channel)."""
    msg = apb.AttendStreamRequest(layer=apb.LayerInput(layer=layer))
    if x is not None:
        encode_tensor(x.query, msg.layer.query)
        encode_tensor(x.key, msg.layer.key)
        encode_tensor(x.value, msg.layer.value)
    return msg


def step_end(step_id: int) -> apb.AttendStreamRequest:
    """The message that ends a step on a stream that carries the next one."""
    return apb.AttendStreamRequest(end=apb.StepEnd(step_id=step_id))


@dataclass
class StepStream:
    """One server's ``AttendStream``: requests go into ``outbox``; ``replies`` yields LayerPartials.

    ``many``: whether the server takes further steps on it (its initial metadata says so; ``None`` until
    read). ``expires``: ``time.monotonic()`` when the call's deadline passes."""

    address: str = ""
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    call: object = None  # the grpc call: an iterator of replies with cancel()
    sent_at: float = 0.0
    expires: float = 0.0
    many: bool | None = None
    layers_sent: int = 0  # in the current step
    step_deadline: float = 0.0  # time.perf_counter() when the current step's deadline passes

    def requests(self) -> Iterator[apb.AttendStreamRequest]:
        while (msg := self.outbox.get()) is not None:
            yield msg

    def reply(self) -> apb.LayerPartial:
        try:
            return next(self.call)  # type: ignore[call-overload]
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        except StopIteration:
            raise error_from_rpc(_EndedEarly()) from None

    def sending(self) -> None:
        """A layer of the current step is sent now: its reply is owed from here."""
        self.sent_at = time.perf_counter()
        self.layers_sent += 1

    def takes_more_steps(self) -> bool:
        """Whether the server advertised StepEnd (reads the initial metadata once: it arrived with the first
        reply, or, on a channel step, before the server served it)."""
        if self.many is None:
            try:
                metadata = self.call.initial_metadata() or ()  # type: ignore[attr-defined]
            except grpc.RpcError:
                metadata = ()
            self.many = (STEPS_PER_STREAM_KEY, STEPS_PER_STREAM_MANY) in tuple(metadata)
        return self.many

    def end(self) -> None:
        """Half-close (the request-consumer thread returns)."""
        self.outbox.put(None)


class _EndedEarly(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the attention server ended a step's stream before answering every layer"


class StubCache:
    """One channel and stub per attention server, by address (re-made when a server's address changes)."""

    def __init__(self, address_of: Callable[[HolderId], str]) -> None:
        self._address_of = address_of
        self._stubs: dict[HolderId, tuple[str, agrpc.AttentionServerStub]] = {}

    def get(self, server: HolderId) -> agrpc.AttentionServerStub:
        address = self._address_of(server)
        cached = self._stubs.get(server)
        if cached is None or cached[0] != address:
            cached = (address, agrpc.AttentionServerStub(sync_channel(address)))
            self._stubs[server] = cached
        return cached[1]


class GrpcTransport:
    """:class:`~infinite_llm.core.dist_attention.AttentionTransport` over ``AttendStream`` (tensors inline).

    Args:
        address_of: ``host:port`` of an attention server.
        timeout_s: the deadline of each step (seconds).
        on_rpc: told each server's seconds per layer (metrics).

    ``num_streams_opened`` counts the ``AttendStream`` calls made (one per server while they stay healthy).
    """

    def __init__(self, address_of: Callable[[HolderId], str], timeout_s: float = 30.0, on_rpc: OnRpc | None = None):
        self.stubs = StubCache(address_of)
        self.address_of = address_of
        self.timeout_s = timeout_s
        self._on_rpc = on_rpc
        self._steps: dict[int, dict[HolderId, StepStream]] = {}
        self._idle: dict[HolderId, StepStream] = {}  # each server's stream between steps
        self.dtype = ""  # the dtype name channel steps declare (set by a transport with channels)
        self._ending: list = []  # calls of closed one-step streams, kept until they end (dropping one cancels it)
        self.stall = StallWatch()
        self.num_streams_opened = 0

    def open_step(
        self,
        step_id: int,
        plans: Mapping[HolderId, list[SeqStep]],
        num_heads: int,
        num_kv_rows: Mapping[HolderId, int] | None = None,
    ) -> None:
        streams: dict[HolderId, StepStream] = {}
        self._steps[step_id] = streams
        deadline = time.perf_counter() + self.timeout_s
        for server, seqs in plans.items():
            stream = self._stream(server)
            stream.layers_sent, stream.step_deadline = 0, deadline
            # A channel step's buffers are sized by num_kv_rows: without it, the tensors travel inline.
            channel = self.tensor_channel(server) if num_kv_rows is not None else ""
            rows = num_kv_rows[server] if num_kv_rows is not None else 0
            stream.outbox.put(step_open(step_id, seqs, num_heads, channel, rows, self.dtype if channel else ""))
            streams[server] = stream

    def _stream(self, server: HolderId) -> StepStream:
        """The server's idle stream if it can take a step, else a new call."""
        address = self.address_of(server)
        stream = self._idle.pop(server, None)
        if stream is not None:
            usable = stream.address == address and time.monotonic() + self.timeout_s < stream.expires
            if usable and not stream.call.done():  # type: ignore[attr-defined]
                return stream
            self._drop(stream)
        stream = StepStream(address=address, expires=time.monotonic() + STREAM_LIFETIME_S)
        stream.call = self.stubs.get(server).AttendStream(stream.requests(), timeout=STREAM_LIFETIME_S)
        self.num_streams_opened += 1
        return stream

    def _drop(self, stream: StepStream) -> None:
        """End a stream no step will use (cancelling a call that has not ended)."""
        stream.end()
        if not stream.call.done():  # type: ignore[attr-defined]
            stream.call.cancel()  # type: ignore[attr-defined]

    def tensor_channel(self, server: HolderId) -> str:
        """The tensor channel a step to ``server`` names ('' here: tensors travel inline)."""
        return ""

    def attend(self, step_id: int, layer: int, inputs: Mapping[HolderId, LayerInput]) -> dict[HolderId, Partial]:
        """Send the layer to every server first, then collect: the servers compute concurrently."""
        streams = self._steps[step_id]
        for server, x in inputs.items():
            streams[server].sending()
            streams[server].outbox.put(layer_message(layer, x))
        out = {}
        for server in inputs:
            out[server] = self._inline_partial(server, streams[server], layer)
            self._observe(server, streams[server].sent_at)
        return out

    def _inline_partial(self, server: HolderId, stream: StepStream, layer: int) -> Partial:
        """The partial of a layer whose tensors travel in the stream (owed within the stall limit)."""
        reply = self._reply(server, stream, layer)
        return decode_tensor(reply.partial_out, field="partial_out"), decode_tensor(reply.lse, field="lse")

    def _reply(self, server: HolderId, stream: StepStream, layer: int) -> apb.LayerPartial:
        """The layer's reply. Raises ``Unavailable`` when it is overdue (a stalled server) and
        ``DeadlineExceeded`` past the step's deadline; either cancels the call."""
        cancel = stream.call.cancel  # type: ignore[attr-defined]
        with self.stall.owed(server, stream.sent_at, cancel, until=stream.step_deadline) as fired:
            try:
                return stream.reply()
            except InfiniteLLMError:
                if fired():
                    raise self._overdue(server, stream, layer) from None
                raise

    def _overdue(self, server: HolderId, stream: StepStream, layer: int) -> InfiniteLLMError:
        """The error of a layer reply that did not come in time."""
        now = time.perf_counter()
        if now >= stream.step_deadline:
            return DeadlineExceeded(f"a step's deadline ({self.timeout_s:g} s) passed at layer {layer} of {server}")
        return Unavailable(
            f"attention server {server} stalled: no reply to layer {layer} in {now - stream.sent_at:.1f} s"
        )

    def _observe(self, server: HolderId, sent_at: float) -> None:
        seconds = time.perf_counter() - sent_at
        self.stall.observe(server, seconds)
        if self._on_rpc is not None:
            self._on_rpc(server, seconds)

    def close_step(self, step_id: int, failed: bool) -> None:
        """End every stream's step: a good one with a StepEnd (the stream waits for the next step), or a
        half-close where the server takes one step a stream; a failed step cancels its streams (the servers
        drop their plans) and the next step opens new ones. Never raises.

        A half-closed call is kept until it ends on its own: dropping a call cancels it, and a server still
        finishing its step (a channel step answers its last layer before its stream ends) would take that
        for a failure."""
        self._ending = [call for call in self._ending if not call.done()]  # type: ignore[attr-defined]
        for server, stream in self._steps.pop(step_id, {}).items():
            if failed:
                self._drop(stream)
            elif stream.layers_sent and stream.takes_more_steps() and server not in self._idle:
                stream.outbox.put(step_end(step_id))
                self._idle[server] = stream
            else:
                stream.end()
                self._ending.append(stream.call)

    def close(self) -> None:
        """End the idle streams (a step in flight is ended by its ``close_step``)."""
        for stream in self._idle.values():
            stream.end()
        self._idle.clear()
