"""The gateway's view of the mesh: the router over gRPC (``AsyncClient``) and the model's tokenizer.

Channels are opened lazily, on the event loop that first uses them (grpc.aio binds a channel to its loop).
Model cards (id, ``max_model_len``) come from the router's ``ListModels`` and are cached for
``CARDS_TTL_S``; ``/health`` always asks afresh. Every router error leaves here as the gateway's typed error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from infinite_llm.client import AsyncClient
from infinite_llm.client.sdk import Completion, CompletionChunk
from infinite_llm.core.errors import InfiniteLLMError, ModelNotFound, Unavailable
from infinite_llm.rpc.tls import FROM_PROCESS, TlsArg, client_tls

CARDS_TTL_S = 30.0  # the served model never changes under a running router; refresh now and then anyway
T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int  # tokens, prompt + completion
    owned_by: str


class RouterBackend:
    """Generation and model metadata through the router at ``router_address`` (HOST:PORT), as the
    ``gateway`` role (``tls``: see :func:`~infinite_llm.rpc.tls.client_tls`; default the process's identity)."""

    def __init__(self, router_address: str, tokenizer, tls: TlsArg = FROM_PROCESS) -> None:  # noqa: ANN001
        self.router_address = router_address
        self.tls = client_tls(tls, role="gateway")
        self.tokenizer = tokenizer
        self._client: AsyncClient | None = None
        self._cards: tuple[float, list[ServedModel]] | None = None

    def _connect(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(self.router_address, tls=self.tls)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ---- models -------------------------------------------------------------------------------------
    async def models(self, fresh: bool = False, timeout_s: float = 10.0) -> list[ServedModel]:
        """The router's model cards; raises ``Unavailable`` (or another typed error) when it does not answer."""
        if not fresh and self._cards is not None and time.monotonic() - self._cards[0] < CARDS_TTL_S:
            return self._cards[1]
        try:  # through the SDK: a router restarting is retried as for generation
            cards = [
                ServedModel(c.id, c.max_model_len, c.owned_by) for c in await self._connect().model_cards(timeout_s)
            ]
        except Unavailable as e:
            raise Unavailable(f"the mesh is unavailable: router {self.router_address}: {e.message}") from None
        self._cards = (time.monotonic(), cards)
        return cards

    async def model(self, name: str | None) -> ServedModel:
        """The card of ``name`` (None or "": the first served model); raises ``ModelNotFound``."""
        cards = await self.models()
        for card in cards:
            if not name or card.id == name:
                return card
        served = ", ".join(repr(c.id) for c in cards) or "none"
        raise ModelNotFound(f"The model {name!r} does not exist; this mesh serves {served}", param="model")

    # ---- generation ---------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], request_id: str, model: str, **sampling) -> Completion:
        client = self._connect()
        try:
            return await client.generate(prompt, request_id=request_id, model=model, **sampling)
        except InfiniteLLMError as e:
            raise self._from_router(e) from None

    async def stream(
        self, prompt: list[int], request_id: str, model: str, **sampling
    ) -> AsyncIterator[CompletionChunk]:
        """Chunks of one request; closing the iterator (or cancelling its task) cancels it in the mesh."""
        client = self._connect()
        chunks = client.stream(prompt, request_id=request_id, model=model, **sampling)
        try:
            async for chunk in chunks:
                yield chunk
        except InfiniteLLMError as e:
            raise self._from_router(e) from None
        finally:
            await chunks.aclose()

    def _from_router(self, e: InfiniteLLMError) -> InfiniteLLMError:
        if isinstance(e, ModelNotFound):
            self._cards = None  # the router serves something else now: ask again next time
        return e


async def gather_or_cancel(calls: list[Awaitable[T]]) -> list[T]:
    """Run ``calls`` concurrently; the first failure cancels the others (their requests leave the mesh)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all ``streams`` as ``(stream index, item)`` in arrival order.

    The first error of any stream is raised here; leaving early (close, cancel, error) cancels every
    stream still running, which cancels its gRPC call and frees its rBlocks in the mesh.
    """
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
