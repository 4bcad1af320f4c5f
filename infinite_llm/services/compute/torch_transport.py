"""DistAttention's torch.distributed transport: tensors on a 2-rank process group per attention server,
control on the gRPC ``AttendStream`` (plans, errors, deadlines, cancellation).

For each attention server this compute instance opens one tensor channel (``rpc/tensor_channel.py``):
it hosts the rendezvous store, asks the server to join with ``OpenTensorChannel`` and builds rank 0
(gloo on CPU, NCCL between GPUs). A step names the channel and its K/V row count in its ``StepOpen``,
which fixes every layer's byte sizes; per layer only the q|k|v bytes go on the channel and the reply comes
back on it (an int64 status, then ``lse|partial_out``): no gRPC message per layer. A failed status means
the server ended the step's stream with the error, read from there. A server whose channel cannot form (a
``--transport grpc`` server, no route, a timeout) gets its tensors over gRPC from then on, and the reason
is logged once. After a failed step the step's channels are closed and reopened at the next step: bytes
of a failed layer can never reach a later one (tags are unique per step, layer, direction).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

from infinite_llm.core.dist_attention import HolderId, LayerInput, Partial
from infinite_llm.core.errors import InfiniteLLMError, InvalidRequest, Unavailable
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.rpc import codec
from infinite_llm.rpc import tensor_channel as tc
from infinite_llm.rpc.errors import describe_rpc_error
from infinite_llm.services.compute.grpc_transport import GrpcTransport, OnRpc, StepStream, layer_message

log = logging.getLogger(__name__)
OPEN_TIMEOUT_S = 10.0  # forming a pair's group (seconds); past it the server falls back to gRPC
CLOSE_TIMEOUT_S = 2.0  # the best-effort CloseTensorChannel of a retired channel (seconds)


@dataclass
class PairChannel:
    """Rank 0 of one (this instance, attention server) pair: its group, store and where its buffers live."""

    channel_id: str
    address: str  # the server's address when the channel formed (a new address needs a new channel)
    group: dist.ProcessGroup
    store: dist.Store
    device: torch.device


@dataclass
class PostedLayer:
    """One layer in flight on a channel: q|k|v sent, room for the reply posted."""

    server: HolderId
    sent: object  # the send's Work
    received: object  # the receive's Work
    buffer: torch.Tensor  # uint8 [8 + num_tokens*num_heads*(4 + head_dim*itemsize)]: status, lse, partial_out
    sizes: tc.StepSizes

    def finish(self, stream: StepStream, timeout_s: float) -> Partial:
        """The partial once its reply arrived; a failed status raises the error that ended ``stream``.
        Raises ``Unavailable`` when the channel fails or no reply came within ``timeout_s`` seconds (a
        stalled server: the failed step closes the channel)."""
        try:
            self.received.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))  # type: ignore[attr-defined]
        except RuntimeError as e:
            raise Unavailable(f"tensor channel to attention server {self.server} failed: {e}") from None
        if tc.reply_status(self.buffer) != tc.LAYER_OK:
            stream.reply()  # raises the step's error (the server ended the stream with it)
            raise Unavailable(f"attention server {self.server} failed a layer but ended its stream without an error")
        try:
            self.sent.wait()  # type: ignore[attr-defined]  (done: the server consumed it before answering)
        except RuntimeError as e:
            raise Unavailable(f"tensor channel to attention server {self.server} failed: {e}") from None
        lse, out = tc.unpack(self.buffer, self.sizes.reply_fields)
        return out, lse


class TorchTransport(GrpcTransport):
    """:class:`~infinite_llm.core.dist_attention.AttentionTransport`: tensors over torch.distributed.

    Args:
        address_of: ``host:port`` of an attention server.
        device: where this instance computes (CUDA: NCCL channels; otherwise gloo).
        timeout_s: deadline of a step's stream, and of every receive on a channel (seconds).
        on_rpc: told each server's seconds per layer (metrics).
        open_timeout_s: the most a channel may take to form before its server falls back to gRPC.

    Channel steps declare the dtype of their tensors, learnt from the first step, which travels inline.
    """

    def __init__(
        self,
        address_of: Callable[[HolderId], str],
        device: torch.device | str = "cpu",
        timeout_s: float = 30.0,
        on_rpc: OnRpc | None = None,
        open_timeout_s: float = OPEN_TIMEOUT_S,
    ) -> None:
        super().__init__(address_of, timeout_s, on_rpc)
        self.device = torch.device(device)
        self.backend = tc.backend_for(self.device)
        self.open_timeout_s = open_timeout_s
        self.fallbacks: dict[HolderId, tuple[str, str]] = {}  # server -> (its address, why gRPC carries tensors)
        self._channels: dict[HolderId, PairChannel] = {}
        self._step_channels: dict[int, dict[HolderId, PairChannel]] = {}
        self._opening: dict[HolderId, PairChannel] = {}
        self._names = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]

    # ---- steps -------------------------------------------------------------------------------------------
    def open_step(
        self,
        step_id: int,
        plans: Mapping[HolderId, list[SeqStep]],
        num_heads: int,
        num_kv_rows: Mapping[HolderId, int] | None = None,
    ) -> None:
        self._opening = {}
        if not self.dtype:  # a channel step's sizes need the dtype: the first step travels inline
            num_kv_rows = None
            for server in plans:
                self._channel(server)  # the pairs form now, for the next steps
        try:
            super().open_step(step_id, plans, num_heads, num_kv_rows)  # names channels via tensor_channel()
        finally:
            self._step_channels[step_id], self._opening = self._opening, {}

    def tensor_channel(self, server: HolderId) -> str:
        channel = self._channel(server)
        if channel is None:
            return ""
        self._opening[server] = channel
        return channel.channel_id

    def attend(self, step_id: int, layer: int, inputs: Mapping[HolderId, LayerInput]) -> dict[HolderId, Partial]:
        """Every server's bytes first (they compute concurrently), then collect."""
        streams, channels = self._steps[step_id], self._step_channels.get(step_id, {})
        if not self.dtype and inputs:
            self.dtype = codec.dtype_name(next(iter(inputs.values())).query.dtype)
        posted: dict[HolderId, PostedLayer] = {}
        for server, x in inputs.items():
            streams[server].sending()
            channel = channels.get(server)
            if channel is None:
                streams[server].outbox.put(layer_message(layer, x))
            else:
                posted[server] = self._post(channel, server, step_id, layer, x)
        out: dict[HolderId, Partial] = {}
        for server in inputs:
            if server in posted:  # owed within the server's stall limit and the step's deadline (``stall_watch``)
                stream, now = streams[server], time.perf_counter()
                left = min(self.stall.limit(server) - (now - stream.sent_at), stream.step_deadline - now)
                out[server] = posted[server].finish(stream, left)
            else:
                out[server] = self._inline_partial(server, streams[server], layer)
            self._observe(server, streams[server].sent_at)
        return out

    def _post(self, channel: PairChannel, server: HolderId, step_id: int, layer: int, x: LayerInput) -> PostedLayer:
        n, h, d = x.query.shape  # query [num_tokens, num_heads, head_dim]
        _, hkv, _ = x.key.shape  # key, value [num_kv_rows, num_kv_heads, head_dim]
        sizes = tc.step_sizes(n, h, x.key.shape[0], hkv, d, x.query.dtype)
        if codec.dtype_name(x.query.dtype) != self.dtype:
            raise InvalidRequest(f"a layer of {x.query.dtype} on a transport declared for {self.dtype}")
        sent = channel.group.send(
            [tc.pack([x.query, x.key, x.value], channel.device)], 1, tc.layer_tag(step_id, layer, tc.TO_SERVER)
        )
        buffer = torch.empty(sizes.reply_nbytes, dtype=torch.uint8, device=channel.device)
        received = channel.group.recv([buffer], 1, tc.layer_tag(step_id, layer, tc.TO_COMPUTE))
        return PostedLayer(server, sent, received, buffer, sizes)

    def close_step(self, step_id: int, failed: bool) -> None:
        """As gRPC; a failed step also retires its channels (reopened at the next step). Never raises."""
        super().close_step(step_id, failed)
        for server, channel in self._step_channels.pop(step_id, {}).items():
            if failed:
                self._retire(server, channel)

    def close(self) -> None:
        """End the idle streams and close every channel (best effort, in the background)."""
        super().close()
        for server, channel in list(self._channels.items()):
            self._retire(server, channel)

    # ---- channels ----------------------------------------------------------------------------------------
    def _channel(self, server: HolderId) -> PairChannel | None:
        """The server's open channel, opened now if need be; ``None``: its tensors travel over gRPC."""
        address = self.address_of(server)
        fallback = self.fallbacks.get(server)
        if fallback is not None and fallback[0] == address:
            return None
        channel = self._channels.get(server)
        if channel is not None and channel.address == address:
            return channel
        if channel is not None:
            self._retire(server, channel)
        try:
            channel = self._open(server, address)
        except (grpc.RpcError, RuntimeError, ValueError, TimeoutError, AttributeError) as e:
            reason = describe_rpc_error(e) if isinstance(e, grpc.RpcError) else str(e)
            self.fallbacks[server] = (address, reason)
            log.warning(
                "attention server %s (%s): tensors travel over gRPC; no tensor channel: %s", server, address, reason
            )
            return None
        self._channels[server] = channel
        return channel

    def _open(self, server: HolderId, address: str) -> PairChannel:
        """Host the store, ask the server to join, build rank 0 once it agreed. Raises on any failure."""
        host = tc.host_towards(address.rsplit(":", 1)[0].strip("[]"))
        timeout = datetime.timedelta(seconds=self.open_timeout_s)
        store = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        channel_id = f"{self._prefix}-{server}-{next(self._names)}"
        request = apb.OpenTensorChannelRequest(
            channel_id=channel_id,
            store_host=host,
            store_port=store.port,
            backend=self.backend,
            timeout_ms=int(self.timeout_s * 1000),
        )
        answer = self.stubs.get(server).OpenTensorChannel.future(request, timeout=self.open_timeout_s)
        deadline = time.monotonic() + self.open_timeout_s
        while not store.check([tc.ACCEPTED + channel_id]):  # building rank 0 first would wait out a refusal
            if answer.done():
                answer.result()  # raises the server's refusal
                raise RuntimeError("the server answered OpenTensorChannel without joining")
            if time.monotonic() > deadline:
                answer.cancel()
                raise TimeoutError(f"the server did not join within {self.open_timeout_s} s")
            time.sleep(0.002)
        group = tc.pair_group(store, channel_id, 0, self.backend, host, self.open_timeout_s)
        answer.result()
        log.info("attention server %s: tensor channel %s open (%s)", server, channel_id, self.backend)
        return PairChannel(channel_id, address, group, store, tc.buffer_device(self.backend, self.device))

    def _retire(self, server: HolderId, channel: PairChannel) -> None:
        """Forget ``channel`` now; tell the server and free the group in the background (never blocks)."""
        if self._channels.get(server) is channel:
            del self._channels[server]

        def close() -> None:
            try:
                self.stubs.get(server).CloseTensorChannel(
                    apb.CloseTensorChannelRequest(channel_id=channel.channel_id), timeout=CLOSE_TIMEOUT_S
                )
            except (grpc.RpcError, InfiniteLLMError) as e:
                log.debug("closing tensor channel %s: %s", channel.channel_id, e)
            channel.group = channel.store = None  # type: ignore[assignment]  (the last references)

        threading.Thread(target=close, name=f"close-{channel.channel_id[:24]}", daemon=True).start()
