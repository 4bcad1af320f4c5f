"""AttentionServer servicer: decode with the codec, call the holder, encode the reply. Nothing else.

Holder calls (and the decode/encode around them) run off the event loop, on one dedicated thread or on a
tensor channel's thread, under one lock, so the RManager is never touched concurrently and the event loop
stays free for health checks and streaming. A step that names a tensor channel (``tensor_channels.py``) is
served whole on the channel's thread: plan, then per layer receive q|k|v, attend, send the reply; nothing
crosses the event loop per layer. Errors are typed (``core/errors.py``) and become status codes in
``rpc/interceptors/errors.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from opentelemetry import propagate, trace

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import FailedPrecondition, InfiniteLLMError, InvalidRequest, NotFound
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as pb_grpc
from infinite_llm.rpc import codec
from infinite_llm.rpc import tensor_channel as tc
from infinite_llm.rpc.options import STEPS_PER_STREAM_KEY, STEPS_PER_STREAM_MANY
from infinite_llm.services.attention.served_rmanager import ServedRManager
from infinite_llm.services.attention.tensor_channels import TensorChannel, TensorChannels
from infinite_llm.services.attention.types import ServerStep
from infinite_llm.services.attention.validation import check_payload_values

T = TypeVar("T")
log = logging.getLogger(__name__)
_TRACER = trace.get_tracer(__name__)
MAX_CHUNK_BYTES = 16 << 20  # an export chunk larger than this defeats the point of streaming
# A layer of at most this many (query, key) pairs runs on the event loop: a decode batch over a short context,
# whose attention takes less than the executor's two thread hops (~0.15 ms a layer on 2 CPU cores, SmolLM2 at
# batch 1); at the limit it holds the loop ~1 ms on one CPU core.
INLINE_MAX_PAIRS = 1 << 17


class AttentionServicer(pb_grpc.AttentionServerServicer):
    """Serves one :class:`ServedRManager`. Call :meth:`close` after the server stopped.

    ``channels``: the tensor channels this server accepts (``None``: tensors travel in the stream only).
    """

    def __init__(self, holder: ServedRManager, server_id: str, channels: TensorChannels | None = None) -> None:
        self.on_attend_step: Callable[[float], None] | None = None  # seconds per layer of a step (metrics)
        self.holder = holder
        self.server_id = server_id
        self.channels = channels
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rmanager-{server_id}")
        self._lock = threading.Lock()  # the holder is not thread-safe: its executor and channel threads take turns
        self._stopping = asyncio.Event()  # begin_stop(): AttendStreams end between steps

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._locked, fn, *args)

    def _locked(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            return fn(*args)

    def close(self) -> None:
        if self.channels is not None:
            self.channels.close_all()
        self._executor.shutdown(wait=True)

    async def fence(self) -> None:
        """This server's lease expired (it was paused or cut off): the cluster counts its KV as lost and
        recomputes those sequences elsewhere, so it drops every rBlock and reservation and rejoins empty."""
        freed = await self._run(self.holder.reset)
        log.warning("lease of %s was lost: fenced, %d rBlocks dropped before registering again", self.server_id, freed)

    # ---- placement -----------------------------------------------------------------------------------
    async def ReserveBlocks(self, request: pb.ReserveBlocksRequest, context) -> pb.ReserveBlocksResponse:
        r, uncached = await self._run(self._reserve, request.seq_id, request.num_blocks)
        return pb.ReserveBlocksResponse(
            reservation_id=r.reservation_id, block_ids=r.block_ids, uncached_hashes=uncached
        )

    def _reserve(self, seq_id: str, num_blocks: int) -> tuple[Reservation, list[bytes]]:
        """Reserve, and the hashes that left the prefix cache (a reservation may evict parked rBlocks)."""
        return self.holder.reserve(seq_id, num_blocks), self.holder.take_uncached()

    async def AttachBlocks(self, request: pb.AttachBlocksRequest, context) -> pb.AttachBlocksResponse:
        if request.reserve:
            r, uncached = await self._run(self._reserve_prefix, request.seq_id, list(request.block_hashes))
            return pb.AttachBlocksResponse(
                block_ids=r.block_ids, uncached_hashes=uncached, reservation_id=r.reservation_id
            )
        args = (request.seq_id, request.first_block_index, list(request.block_hashes))
        ids, uncached = await self._run(self._attach, *args)
        return pb.AttachBlocksResponse(block_ids=ids, uncached_hashes=uncached)

    def _attach(self, seq_id: str, first_index: int, hashes: list[bytes]) -> tuple[list[int], list[bytes]]:
        return self.holder.attach_prefix(seq_id, first_index, hashes), self.holder.take_uncached()

    def _reserve_prefix(self, seq_id: str, hashes: list[bytes]) -> tuple[Reservation, list[bytes]]:
        return self.holder.reserve_prefix(seq_id, hashes), self.holder.take_uncached()

    async def CacheBlocks(self, request: pb.CacheBlocksRequest, context) -> pb.CacheBlocksResponse:
        args = (request.seq_id, list(request.block_indices), list(request.block_hashes))
        return pb.CacheBlocksResponse(cached_hashes=await self._run(self.holder.cache_blocks, *args))

    async def BlockReaders(self, request: pb.BlockReadersRequest, context) -> pb.BlockReadersResponse:
        found = await self._run(self.holder.block_readers, list(request.block_hashes))
        readers = [pb.BlockReader(block_hash=h, seq_id=s, block_index=i) for h, s, i in found]
        return pb.BlockReadersResponse(readers=readers)

    async def CommitBlocks(self, request: pb.CommitBlocksRequest, context) -> pb.CommitBlocksResponse:
        seq_id, ids, cached = await self._run(self.holder.commit, request.reservation_id, list(request.block_indices))
        return pb.CommitBlocksResponse(seq_id=seq_id, block_ids=ids, cached_hashes=cached)

    async def CancelReservation(self, request: pb.CancelReservationRequest, context) -> pb.CancelReservationResponse:
        await self._run(self.holder.cancel, request.reservation_id)
        return pb.CancelReservationResponse()

    async def FreeSequence(self, request: pb.FreeSequenceRequest, context) -> pb.FreeSequenceResponse:
        indices = list(request.block_indices)
        from_index = request.from_block_index if request.HasField("from_block_index") else None
        if from_index is not None and indices:
            raise InvalidRequest("give block_indices or from_block_index, not both", param="from_block_index")
        freed = await self._run(self.holder.free_sequence, request.seq_id, indices, from_index)
        return pb.FreeSequenceResponse(num_freed=freed, num_held=await self._run(self.holder.num_held, request.seq_id))

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        s = await self._run(self.holder.stats)
        return pb.GetStatsResponse(
            server_id=self.server_id,
            layout=codec.kv_layout_message(self.holder.layout),
            num_blocks=s.num_blocks,
            num_free=s.num_free,
            num_used=s.num_used,
            num_reserved=s.num_reserved,
            num_sequences=s.num_sequences,
            bytes_per_block=s.bytes_per_block,
            capacity_bytes=s.capacity_bytes,
            used_bytes=s.used_bytes,
            num_cached=s.num_cached,
        )

    # ---- attention -----------------------------------------------------------------------------------
    async def AttendStream(self, request_iterator, context) -> AsyncIterator[pb.LayerPartial]:
        """Steps, one after another: each is planned once from its StepOpen, then answers one LayerPartial per
        LayerInput until its StepEnd (the stream then waits for the next StepOpen) or the client's half-close.
        A step's plan lives until its end; an error ends the stream with its status. Between steps a stopping
        server ends the stream OK (it would otherwise hold its graceful stop for the whole grace period)."""
        await context.send_initial_metadata(((STEPS_PER_STREAM_KEY, STEPS_PER_STREAM_MANY),))
        stream = aiter(request_iterator)
        msg = await anext(stream, None)
        if msg is None or msg.WhichOneof("part") != "open":
            raise InvalidRequest("an AttendStream must start with a StepOpen")
        while msg is not None:
            if msg.WhichOneof("part") != "open":
                raise InvalidRequest("an AttendStream step must start with a StepOpen, after the last StepEnd")
            with _step_span(msg.open):
                if msg.open.tensor_channel:
                    await self._channel_step(msg.open)  # the layers travel on the channel: nothing to yield
                    end = await anext(stream, None)
                    if end is None:
                        return  # the client half-closed: its last step ended
                    if not _ends(end, msg.open.step_id):
                        raise InvalidRequest("a channel step's stream carries only its StepEnd after the StepOpen")
                else:
                    seqs = [_seq_step(s) for s in msg.open.seqs]
                    step, small = await self._run(self._open_step, seqs, msg.open.num_heads)
                    async for layer in stream:
                        if _ends(layer, msg.open.step_id):
                            break
                        if layer.WhichOneof("part") != "layer":
                            raise InvalidRequest("an AttendStream step carries exactly one StepOpen, first")
                        yield await self._attend(step, small, layer.layer)
                    else:
                        return  # the client half-closed: its last step ended
            msg = await self._next_step(stream)

    async def _next_step(self, stream: AsyncIterator[pb.AttendStreamRequest]) -> pb.AttendStreamRequest | None:
        """The message after a StepEnd; ``None`` at the client's half-close or when this server stops first."""
        if self._stopping.is_set():
            return None
        following = asyncio.ensure_future(anext(stream, None))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((following, stopping), return_when=asyncio.FIRST_COMPLETED)
            return following.result() if following.done() else None
        finally:  # also when the call is cancelled while it waits: no task is left pending
            stopping.cancel()
            if not following.done():
                following.cancel()

    def begin_stop(self) -> None:
        """The server is stopping: every AttendStream ends at its current step's end (or now, when idle)."""
        self._stopping.set()

    def _open_step(self, seqs: list[SeqStep], num_heads: int) -> tuple[ServerStep, bool]:
        """The step's plan, and whether its layers are small enough to run on the event loop: at most
        ``INLINE_MAX_PAIRS`` (query, key) pairs here (read once per step: on a GPU it is a host sync)."""
        step = self.holder.open_step(seqs, num_heads)
        keys_here = int(step.plan.meta.num_blocks.sum()) * self.holder.layout.block_size  # at most
        return step, step.plan.num_tokens * keys_here <= INLINE_MAX_PAIRS

    async def _attend(self, step: ServerStep, small: bool, msg: pb.LayerInput) -> pb.LayerPartial:
        """A small layer runs right here when the holder is free: two thread hops cost more than it; a
        larger one, or one that would wait for the lock, runs on the executor."""
        if small and self._lock.acquire(blocking=False):
            try:
                return self._attend_layer(step, msg)
            finally:
                self._lock.release()
        return await self._run(self._attend_layer, step, msg)

    def _attend_layer(self, step: ServerStep, msg: pb.LayerInput) -> pb.LayerPartial:
        query = codec.decode_tensor(msg.query, field="query")
        key = codec.decode_tensor(msg.key, field="key")
        value = codec.decode_tensor(msg.value, field="value")
        start = time.perf_counter()
        out, lse = self.holder.attend_layer(step, msg.layer, query, key, value)
        if self.on_attend_step is not None:
            self.on_attend_step(time.perf_counter() - start)
        reply = pb.LayerPartial(layer=msg.layer)
        codec.encode_tensor(out, reply.partial_out)
        codec.encode_tensor(lse, reply.lse)
        return reply

    async def _channel_step(self, open_msg: pb.StepOpen) -> None:
        """A step whose layers travel on a tensor channel, served on the channel's thread from its plan to
        its last layer (no per-layer hop through the event loop). A cancelled stream closes the channel,
        which unblocks its thread; the compute instance opens another. Raises the failed layer's error."""
        layout = self.holder.layout
        try:  # a step that cannot be served closes the channel: the peer's wait fails now, not at its timeout
            channel = self._channels().get(open_msg.tensor_channel)
            sizes = tc.StepSizes(
                num_tokens=sum(s.num_new for s in open_msg.seqs),
                num_heads=open_msg.num_heads,
                num_kv_rows=open_msg.num_kv_rows,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                dtype=codec.dtype_from_name(open_msg.dtype, field="dtype") if open_msg.dtype else layout.dtype,
            )
            channel.check_sizes(sizes)
        except InfiniteLLMError:
            self._discard(open_msg.tensor_channel)
            raise
        served = threading.Event()  # set once the step's last reply is queued (or the step failed)
        future = asyncio.get_running_loop().run_in_executor(
            channel.thread, self._serve_channel_step, channel, open_msg, sizes, served
        )
        try:
            error = await future
        except asyncio.CancelledError:
            if not served.is_set():  # the thread may wait for a layer that will never come
                self._discard(open_msg.tensor_channel)
            raise
        except Exception:  # the channel broke: closing it fails the peer's wait now, not at its timeout
            self._discard(open_msg.tensor_channel)
            raise
        if error is not None:
            raise error

    def _serve_channel_step(
        self, channel: TensorChannel, open_msg: pb.StepOpen, sizes: tc.StepSizes, served: threading.Event
    ) -> Exception | None:
        """Channel thread: plan the step (its error answers layer 0), then serve every layer."""
        seqs = [_seq_step(s) for s in open_msg.seqs]
        try:
            with self._lock:
                step: ServerStep | Exception = self.holder.open_step(seqs, open_msg.num_heads)
            if step.plan.num_new_here != sizes.num_kv_rows:
                raise InvalidRequest(
                    f"num_kv_rows is {sizes.num_kv_rows}; this server stores {step.plan.num_new_here} rows of the step"
                )
        except Exception as e:  # noqa: BLE001 (sent as layer 0's failed status, then raised by the stream)
            step = e

        def attend(
            layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if isinstance(step, Exception):
                raise step
            start = time.perf_counter()
            with self._lock:
                out, lse = self.holder.attend_layer(step, layer, query, key, value)
            if self.on_attend_step is not None:
                self.on_attend_step(time.perf_counter() - start)
            return lse, out

        try:
            return channel.serve_step(open_msg.step_id, self.holder.layout.num_layers, sizes, attend)
        finally:
            served.set()

    def _discard(self, channel_id: str) -> None:
        try:
            self._channels().close(channel_id)
        except InfiniteLLMError:
            pass  # closed meanwhile (CloseTensorChannel), or this server takes no channels

    # ---- tensor channels ----------------------------------------------------------------------------
    def _channels(self) -> TensorChannels:
        if self.channels is None:
            raise FailedPrecondition(
                f"attention server {self.server_id} takes tensors over gRPC only (started with --transport grpc)"
            )
        return self.channels

    async def OpenTensorChannel(self, request: pb.OpenTensorChannelRequest, context) -> pb.OpenTensorChannelResponse:
        channels = self._channels()
        args = (request.channel_id, request.store_host, request.store_port, request.backend, request.timeout_ms)
        channel = await asyncio.to_thread(channels.open, *args)  # blocks until the pair's group formed
        return pb.OpenTensorChannelResponse(device=str(channel.device))

    async def CloseTensorChannel(self, request: pb.CloseTensorChannelRequest, context) -> pb.CloseTensorChannelResponse:
        await asyncio.to_thread(self._channels().close, request.channel_id)
        return pb.CloseTensorChannelResponse()

    # ---- migration -----------------------------------------------------------------------------------
    async def ExportBlocks(self, request: pb.ExportBlocksRequest, context) -> AsyncIterator[pb.BlockTransferChunk]:
        chunk_bytes = request.chunk_bytes or codec.CHUNK_BYTES
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidRequest(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        exported = await self._run(self.holder.export_blocks, request.seq_id, list(request.block_ids))
        ids, indices, hashes, payload = exported
        data = await self._run(codec.tensor_to_bytes, payload)
        meta = codec.tensor_meta(payload.dtype, payload.shape)
        header = pb.BlockTransferHeader(
            seq_id=request.seq_id,
            block_ids=ids,
            block_indices=indices,
            payload=meta,
            block_hashes=hashes if any(hashes) else [],
        )
        yield pb.BlockTransferChunk(header=header)
        for chunk in codec.split_chunks(data, chunk_bytes):
            yield pb.BlockTransferChunk(data=chunk)

    async def ImportBlocks(self, request_iterator, context) -> pb.ImportBlocksResponse:
        stream = aiter(request_iterator)
        first = await anext(stream, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidRequest("an ImportBlocks stream must start with a header")
        header = first.header
        dtype = codec.dtype_from_name(header.payload.dtype, field="payload")
        shape = list(header.payload.shape)
        indices = list(header.block_indices)
        if len(indices) != (shape[2] if len(shape) == 6 else -1):
            raise InvalidRequest(f"the header gives {len(indices)} block_indices for payload shape {shape}")
        if header.reservation_id and header.reservation_ids:
            raise InvalidRequest("give reservation_id or reservation_ids, not both", param="reservation_ids")
        rids = list(header.reservation_ids) or ([header.reservation_id] if header.reservation_id else [])
        if header.stage and (not rids or 0 in rids):
            raise InvalidRequest("a staged import lands in a reservation: set reservation_id", param="reservation_id")
        reservations = await self._run(self.holder.begin_import, header.seq_id, shape, dtype, rids)
        try:
            # Allocated only now that the shape matched the layout and its rBlocks are reserved.
            assembler = codec.ChunkAssembler(codec.payload_nbytes(header.payload))
            async for chunk in stream:
                if chunk.WhichOneof("part") != "data":
                    raise InvalidRequest("an ImportBlocks stream carries exactly one header, first")
                assembler.add(chunk.data)
            payload = codec.tensor_from_buffer(header.payload.dtype, shape, assembler.finish(), field="payload")
            hashes = list(header.block_hashes)
            await asyncio.to_thread(check_payload_values, payload)  # outside the lock the steps take
            finish = self.holder.finish_import
            ids, cached = await self._run(finish, reservations, indices, payload, hashes, header.stage, True)
        except BaseException:  # incl. a cancelled stream: the blocks never become readable
            await asyncio.shield(self._run(self._cancel_quietly, reservations))
            raise
        return pb.ImportBlocksResponse(seq_id=header.seq_id, block_ids=ids, cached_hashes=cached)

    def _cancel_quietly(self, reservations: list[Reservation]) -> None:
        for reservation in reservations:
            try:
                self.holder.cancel(reservation.reservation_id)
            except NotFound:
                pass  # already gone with its sequence (FreeSequence)


@contextlib.contextmanager
def _step_span(open_msg: pb.StepOpen) -> Iterator[None]:
    """A server span of one step in the trace its StepOpen carries (none when it carries none). Not made
    current: the handler yields between layers, and nothing under it makes spans."""
    if not open_msg.trace_context:
        yield
        return
    parent = propagate.extract(dict(open_msg.trace_context))
    attributes = {"infinite_llm.step_id": open_msg.step_id, "infinite_llm.num_seqs": len(open_msg.seqs)}
    span = _TRACER.start_span("AttendStream step", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
    try:
        yield
    except BaseException as e:
        span.record_exception(e)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
        raise
    finally:
        span.end()


def _ends(msg: pb.AttendStreamRequest, step_id: int) -> bool:
    """Whether ``msg`` is the StepEnd of step ``step_id``; raises for another step's."""
    if msg.WhichOneof("part") != "end":
        return False
    if msg.end.step_id != step_id:
        raise InvalidRequest(f"a StepEnd of step {msg.end.step_id} in step {step_id}", param="end.step_id")
    return True


def _seq_step(msg: pb.StepSeq) -> SeqStep:
    return SeqStep(
        msg.seq_id,
        msg.num_computed_tokens,
        msg.num_new,
        msg.num_blocks_here if msg.HasField("num_blocks_here") else None,
    )
