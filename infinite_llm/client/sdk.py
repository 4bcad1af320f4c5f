"""Sync and asyncio clients of the Router (``infinite_llm.v1.Router``).

Both take the same keyword arguments as :class:`infinite_llm.core.sampling.SamplingParams` (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``) and a
``timeout`` in seconds for the whole call. A prompt is text or a list of token ids.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from infinite_llm.client.errors import InvalidRequest, MessageTooLarge, error_from_rpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.options import MAX_MESSAGE_BYTES, channel_options
from infinite_llm.services.generate_codec import sampling_to_proto

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class CompletionChunk:
    """One streamed message: new tokens and text; the last one has ``finish_reason`` and usage."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    placement: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0


Completion = CompletionChunk  # a unary reply carries every token, the whole text and the usage


def _chunk(msg: gpb.GenerateResponse) -> CompletionChunk:
    return CompletionChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=msg.finish_reason or None,
        prompt_tokens=msg.usage.prompt_tokens,
        completion_tokens=msg.usage.completion_tokens,
        placement={p.server_id: p.num_blocks for p in msg.placement},
        num_preemptions=msg.num_preemptions,
    )


def _request(prompt: str | list[int], request_id: str | None, model: str | None, **sampling) -> gpb.GenerateRequest:
    """The message of one request. Raises ``InvalidRequest`` for text that is not valid Unicode (a lone
    UTF-16 surrogate: protobuf strings are UTF-8) and ``MessageTooLarge`` past the gRPC message limit."""
    try:
        req = gpb.GenerateRequest(
            request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
            model=model or "",
            sampling=sampling_to_proto(**sampling),
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"the request holds text that is not valid Unicode: {e.reason} ({e.object[e.start : e.end]!r})"
        ) from None
    if req.ByteSize() > MAX_MESSAGE_BYTES:  # gRPC would refuse it with RESOURCE_EXHAUSTED, as if the mesh were full
        raise MessageTooLarge(
            f"the request is {req.ByteSize()} bytes, over the {MAX_MESSAGE_BYTES}-byte gRPC message limit; "
            "no model context is that long",
            param="prompt",
        )
    return req


class Client:
    """Blocking client. Use as a context manager or call :meth:`close`."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target, options=channel_options())
        self._stub = rgrpc.RouterStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> Completion:
        try:
            return _chunk(
                self._stub.Generate(
                    _request(prompt, request_id, model, max_tokens=max_tokens, **sampling), timeout=timeout
                )
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def stream(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> Iterator[CompletionChunk]:
        """Yield chunks as they come; closing the iterator early cancels the request (its rBlocks are freed)."""
        call = self._stub.GenerateStream(
            _request(prompt, request_id, model, max_tokens=max_tokens, **sampling), timeout=timeout
        )
        try:
            for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            call.cancel()

    def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        try:
            return self._stub.Abort(gpb.AbortRequest(request_id=request_id), timeout=timeout).aborted
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def list_models(self, timeout: float = 10.0) -> list[str]:
        try:
            return [m.id for m in self._stub.ListModels(rpb.ListModelsRequest(), timeout=timeout).models]
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def tokenize(self, text: str, add_special_tokens: bool = True, timeout: float = 10.0) -> list[int]:
        try:
            req = rpb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
            return list(self._stub.Tokenize(req, timeout=timeout).token_ids)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None


class AsyncClient:
    """asyncio client (``grpc.aio``); same methods as :class:`Client`, awaitable."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        self._stub = rgrpc.RouterStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> Completion:
        try:
            req = _request(prompt, request_id, model, max_tokens=max_tokens, **sampling)
            return _chunk(await self._stub.Generate(req, timeout=timeout))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def stream(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> AsyncIterator[CompletionChunk]:
        call = self._stub.GenerateStream(
            _request(prompt, request_id, model, max_tokens=max_tokens, **sampling), timeout=timeout
        )
        try:
            async for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            call.cancel()

    async def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        try:
            return (await self._stub.Abort(gpb.AbortRequest(request_id=request_id), timeout=timeout)).aborted
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def list_models(self, timeout: float = 10.0) -> list[str]:
        try:
            return [m.id for m in (await self._stub.ListModels(rpb.ListModelsRequest(), timeout=timeout)).models]
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
