"""DistAttention's gRPC transport: one bidirectional ``AttendStream`` per attention server and step.

The stream opens with a ``StepOpen`` (step id, and per sequence only ``seq_id``, ``num_computed_tokens``,
``num_new``: the server plans the step once from the rBlocks it recorded at commit), then carries one
``LayerInput`` (queries + the new K/V stored there) per layer, each answered by one ``LayerPartial``
(``partial_out`` + ``lse``). A layer's bytes depend on the step's new tokens only, never on the context
(DESIGN.md §3). The deadline covers the whole step, and each layer's reply has its own (``stall_watch``:
seconds, from the server's recent pace); an error ends the stream with its status, which becomes the typed
error here (``UNAVAILABLE``, a stalled server's too, makes the compute instance recompute on the survivors).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.core.dist_attention import HolderId, LayerInput, Partial
from infinite_llm.core.errors import InfiniteLLMError, Unavailable
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.codec import decode_tensor, encode_tensor
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
    """The first message of a step's stream to one server."""
    return apb.AttendStreamRequest(
        open=apb.StepOpen(
            step_id=step_id,
            num_heads=num_heads,
            tensor_channel=tensor_channel,
            num_kv_rows=num_kv_rows,
            dtype=dtype,
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


@dataclass
class StepStream:
    """One server's stream of one step: requests go into ``outbox``; ``replies`` yields LayerPartials."""

    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    call: object = None  # the grpc call: an iterator of replies with cancel()
    sent_at: float = 0.0

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
    """:class:`~infinite_llm.core.dist_attention.AttentionTransport` over ``AttendStream`` (tensors inline)."""

    def __init__(self, address_of: Callable[[HolderId], str], timeout_s: float = 30.0, on_rpc: OnRpc | None = None):
        self.stubs = StubCache(address_of)
        self.timeout_s = timeout_s
        self._on_rpc = on_rpc
        self._steps: dict[int, dict[HolderId, StepStream]] = {}
        self.dtype = ""  # the dtype name channel steps declare (set by a transport with channels)
        self._ending: list = []  # calls of closed good steps, kept until they end (dropping one cancels it)
        self.stall = StallWatch()

    def open_step(
        self,
        step_id: int,
        plans: Mapping[HolderId, list[SeqStep]],
        num_heads: int,
        num_kv_rows: Mapping[HolderId, int] | None = None,
    ) -> None:
        streams: dict[HolderId, StepStream] = {}
        self._steps[step_id] = streams
        for server, seqs in plans.items():
            stream = StepStream()
            # A channel step's buffers are sized by num_kv_rows: without it, the tensors travel inline.
            channel = self.tensor_channel(server) if num_kv_rows is not None else ""
            rows = num_kv_rows[server] if num_kv_rows is not None else 0
            stream.outbox.put(step_open(step_id, seqs, num_heads, channel, rows, self.dtype if channel else ""))
            stream.call = self.stubs.get(server).AttendStream(stream.requests(), timeout=self.timeout_s)
            streams[server] = stream

    def tensor_channel(self, server: HolderId) -> str:
        """The tensor channel a step to ``server`` names ('' here: tensors travel inline)."""
        return ""

    def attend(self, step_id: int, layer: int, inputs: Mapping[HolderId, LayerInput]) -> dict[HolderId, Partial]:
        """Send the layer to every server first, then collect: the servers compute concurrently."""
        streams = self._steps[step_id]
        for server, x in inputs.items():
            streams[server].sent_at = time.perf_counter()
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
        """The layer's reply; ``Unavailable`` when it is overdue (the call is cancelled: a stalled server)."""
        with self.stall.owed(server, stream.sent_at, stream.call.cancel) as fired:  # type: ignore[attr-defined]
            try:
                return stream.reply()
            except InfiniteLLMError:
                if fired():
                    raise Unavailable(
                        f"attention server {server} stalled: no reply to layer {layer} in "
                        f"{time.perf_counter() - stream.sent_at:.1f} s"
                    ) from None
                raise

    def _observe(self, server: HolderId, sent_at: float) -> None:
        seconds = time.perf_counter() - sent_at
        self.stall.observe(server, seconds)
        if self._on_rpc is not None:
            self._on_rpc(server, seconds)

    def close_step(self, step_id: int, failed: bool) -> None:
        """Half-close every stream of the step; a failed step also cancels them (the servers drop their plans).

        The calls of a good step are kept until they end on their own: dropping a call cancels it, and a
        server still finishing its step (a channel step answers its last layer before its stream ends) would
        take that for a failure."""
        self._ending = [call for call in self._ending if not call.done()]  # type: ignore[attr-defined]
        for stream in self._steps.pop(step_id, {}).values():
            stream.outbox.put(None)
            if stream.call is None:
                continue
            if failed:
                stream.call.cancel()  # type: ignore[attr-defined]
            else:
                self._ending.append(stream.call)
