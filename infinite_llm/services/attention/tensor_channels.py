"""The attention server's side of tensor channels (``rpc/tensor_channel.py``): rank 1 of each pair's group.

``OpenTensorChannel`` joins a compute instance's group (:meth:`TensorChannels.open`, blocking: call it from
a thread); AttendStream steps that name a channel receive each layer's q|k|v on it and send the partial
output back on it (:class:`TensorChannel`). Every receive and send of a channel runs on that channel's own
thread, so a stalled peer never blocks the rManager's thread nor the event loop. A channel whose bytes may
be out of step with its peer (a failed receive or send, bytes we could not size) is broken: steps naming it
are refused with UNAVAILABLE (transient: the compute instance recomputes the step's sequences and opens
another channel, as after any lost tensor path).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from infinite_llm.core.errors import FailedPrecondition, InvalidRequest, NotFound, Unavailable
from infinite_llm.rpc import tensor_channel as tc

log = logging.getLogger(__name__)
LayerFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
MAX_TIMEOUT_MS = 10 * 60 * 1000  # a channel's collective timeout is capped at 10 minutes
MAX_LAYER_BYTES = 1 << 31  # one layer's input larger than 2 GiB is not a step this server could hold


class TensorChannel:
    """Rank 1 of one pair's group. Receives run on the channel's ``thread``; a send is only queued (from
    the rManager's thread, right after its layer) and waited on before the channel's next receive."""

    def __init__(self, channel_id: str, group: dist.ProcessGroup, store: dist.Store, device: torch.device) -> None:
        self.channel_id = channel_id
        self.group, self.store, self.device = group, store, device
        self.broken = ""  # why the channel may be out of step with its peer ('' while healthy)
        self._pending: list = []  # send works not yet waited on (their buffers must outlive them)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"channel-{channel_id[:24]}")

    def serve_step(self, step_id: int, num_layers: int, sizes: tc.StepSizes, attend: LayerFn) -> Exception | None:
        """Serve one step's layers ``0 .. num_layers-1`` in order (channel thread): receive each layer's
        q|k|v (``sizes.layer_nbytes``), ``attend(layer, query, key, value) -> (lse, partial_out)``, send the
        reply. A layer that raises gets a failed status and ends the step: returns its error (``None``: every
        layer served). Raises ``Unavailable`` when the channel breaks (its bytes may be out of step).
        """
        reply = tc.ReplyBuffer(sizes, self.device)  # one per step: each layer's send is waited on before the next
        for layer in range(num_layers):
            buffer = self.recv(sizes.layer_nbytes, tc.layer_tag(step_id, layer, tc.TO_SERVER))
            tag = tc.layer_tag(step_id, layer, tc.TO_COMPUTE)
            try:
                lse, out = attend(layer, *tc.unpack(buffer, sizes.layer_fields))
                filled = reply.fill(lse, out)
            except Exception as e:  # noqa: BLE001 (the peer waits for this layer's reply whatever went wrong)
                self.send(tc.failed_reply(sizes.reply_nbytes, self.device), tag)
                return e
            self.send(filled, tag)
        return None

    def recv(self, num_bytes: int, tag: int) -> torch.Tensor:
        """``num_bytes`` bytes from the compute instance (``uint8`` on the channel's device). Channel thread."""
        self._check()
        self._settle()
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)  # (num_bytes,)
        try:
            self.group.recv([buffer], 0, tag).wait()
        except RuntimeError as e:
            self._break(f"receiving a layer failed: {e}")
        return buffer

    def send(self, buffer: torch.Tensor, tag: int) -> None:
        """Queue ``buffer`` (``uint8``) for the compute instance; waited on before the next receive."""
        self._check()
        self._pending.append(self.group.send([buffer], 0, tag))

    def _settle(self) -> None:
        works, self._pending = self._pending, []
        for work in works:
            try:
                work.wait()
            except RuntimeError as e:
                self._break(f"sending a partial failed: {e}")

    def check_sizes(self, sizes: tc.StepSizes) -> None:
        """Refuse a step whose layers could not be received (negative or huge): the peer may already have
        sent bytes nobody can consume, so the channel breaks (raises ``InvalidRequest``)."""
        counts = (sizes.num_tokens, sizes.num_heads, sizes.num_kv_rows)
        if min(counts) < 0 or sizes.num_tokens < 1 or max(sizes.layer_nbytes, sizes.reply_nbytes) > MAX_LAYER_BYTES:
            self.broken = f"a step's layers could not be sized: {counts}"
            raise InvalidRequest(f"a channel step of (num_tokens, num_heads, num_kv_rows) {counts} cannot be sized")

    def _check(self) -> None:
        if self.broken:
            raise Unavailable(f"tensor channel {self.channel_id!r} is broken ({self.broken}); open another")

    def _break(self, reason: str) -> None:
        self.broken = reason
        raise Unavailable(f"tensor channel {self.channel_id!r} broke: {reason}")

    def close(self) -> None:
        """Abort what is in flight and free the group. Any thread; never raises."""
        self.broken = self.broken or "closed"
        try:
            self.group.abort()
        except Exception as e:  # noqa: BLE001 (closing: nothing to do about it)
            log.debug("closing tensor channel %s: %s", self.channel_id, e)
        self.thread.shutdown(wait=False)


class TensorChannels:
    """Registry of one attention server's channels, by ``channel_id``. Thread-safe.

    Args:
        device: where the server keeps its KV; NCCL channels need it to be a GPU.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._channels: dict[str, TensorChannel] = {}
        self._lock = threading.Lock()

    def open(self, channel_id: str, store_host: str, store_port: int, backend: str, timeout_ms: int) -> TensorChannel:
        """Join the compute instance's group (rank 1); blocks until formed or ``timeout_ms`` passed.

        Raises ``InvalidRequest`` for a bad request, ``FailedPrecondition`` when the group cannot form.
        """
        self._check_request(channel_id, store_port, backend, timeout_ms)
        timeout_s = timeout_ms / 1000
        with self._lock:
            if channel_id in self._channels:
                raise InvalidRequest(f"tensor channel {channel_id!r} is already open")
        try:
            store = dist.TCPStore(store_host, store_port, None, False, datetime.timedelta(seconds=timeout_s))
            store.set(tc.ACCEPTED + channel_id, "1")  # the compute instance now builds its rank
            group = tc.pair_group(store, channel_id, 1, backend, tc.host_towards(store_host), timeout_s)
        except (RuntimeError, ValueError, AttributeError) as e:  # DistStoreError/DistNetworkError; no NCCL built
            raise FailedPrecondition(f"tensor channel {channel_id!r} could not form: {e}") from None
        channel = TensorChannel(channel_id, group, store, tc.buffer_device(backend, self.device))
        with self._lock:
            self._channels[channel_id] = channel
        log.info("tensor channel %s open (%s, store %s:%d)", channel_id, backend, store_host, store_port)
        return channel

    def _check_request(self, channel_id: str, store_port: int, backend: str, timeout_ms: int) -> None:
        if not channel_id:
            raise InvalidRequest("channel_id must not be empty")
        if backend not in tc.BACKENDS:
            raise InvalidRequest(f"backend must be one of {tc.BACKENDS}, got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise FailedPrecondition(
                f"an nccl tensor channel needs a GPU server; this one keeps its KV on {self.device}"
            )
        if not 0 < store_port < 65536:
            raise InvalidRequest(f"store_port must be in (0, 65536), got {store_port}")
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
            raise InvalidRequest(f"timeout_ms must be in (0, {MAX_TIMEOUT_MS}], got {timeout_ms}")

    def get(self, channel_id: str) -> TensorChannel:
        """The open channel ``channel_id``; raises ``Unavailable`` if unknown (e.g. after a restart) or broken."""
        with self._lock:
            channel = self._channels.get(channel_id)
        if channel is None:
            raise Unavailable(f"no tensor channel {channel_id!r} is open here")
        channel._check()
        return channel

    def close(self, channel_id: str) -> None:
        """Close ``channel_id``; raises ``NotFound`` if it is not open."""
        with self._lock:
            channel = self._channels.pop(channel_id, None)
        if channel is None:
            raise NotFound(f"no tensor channel {channel_id!r} is open here")
        channel.close()

    def close_all(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._channels)
