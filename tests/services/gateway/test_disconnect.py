"""A client that leaves before a stream's first token: the gateway cancels the pending ``anext()`` and closes
the stream at once, which must not find the stream still unwinding (a helper's walkthrough found two
tracebacks per such disconnect in the gateway's log: ``aclose(): asynchronous generator is already
running``)."""

from __future__ import annotations

import asyncio

import pytest

from infinite_llm.client.errors import Cancelled
from infinite_llm.services.gateway.app import until_disconnect


class LeavingClient:
    """An ASGI request whose client disconnects once ``leave`` is set (``request.receive()`` as Starlette's)."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_a_stream_cancelled_before_its_first_token_closes_without_error():
    cleaned = []

    async def events():
        try:
            await asyncio.sleep(3600)  # the first token: a long prefill
            yield "never"
        finally:
            await asyncio.sleep(0.01)  # unwinding awaits too (the stream's own cancel of its mesh request)
            cleaned.append(True)

    async def main():
        stream, client = events(), LeavingClient()
        asyncio.get_running_loop().call_later(0.05, client.leave.set)
        with pytest.raises(Cancelled):
            await until_disconnect(client, anext(stream))
        await stream.aclose()  # raised RuntimeError while the cancelled anext() was still unwinding

    asyncio.run(main())
    assert cleaned == [True]


def test_work_that_ends_first_gives_its_result_and_its_error():
    async def main():
        client = LeavingClient()

        async def fails():
            raise ValueError("bad")

        assert await until_disconnect(client, asyncio.sleep(0, result=7)) == 7
        with pytest.raises(ValueError, match="bad"):
            await until_disconnect(client, fails())

    asyncio.run(main())
