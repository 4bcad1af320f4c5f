"""A bound on a request body's size, checked before and while it is read: the gateway parses a body into
Python objects (several times its size in memory) before any field is validated, so an unbounded body is a
memory attack on an open gateway. The prompt's own caps (``params.py``: characters before tokenizing, the
model's length after) come later, on the parsed body.

A body whose ``Content-Length`` is over the limit is answered 413 at once, unread; a chunked one (no length)
is counted as it arrives and refused when it passes the limit. The 413 is an OpenAI error object
(``invalid_request_error``, param null) whose message names the limit and the flag that sets it. uvicorn
and Starlette set no limit of their own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from infinite_llm.rpc.sizes import format_size
from infinite_llm.services.gateway.errors import ErrorBody, ErrorResponse

MAX_REQUEST_BYTES = 16 * 1024 * 1024  # the default bound: a prompt at a 8K model's character cap, many times over

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def too_large_message(max_bytes: int) -> str:
    return (
        f"the request body is larger than this gateway takes ({format_size(max_bytes)}; "
        "serve gateway --max-request-bytes)"
    )


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most ``max_bytes`` bytes (0: no limit) reach ``app``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            message = f"{too_large_message(self.max_bytes)} ({scope.get('method')} {scope.get('path')})"
            body = ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error"))
            # Connection: close: the unread body is not drained, so this connection cannot carry another request
            response = JSONResponse(body.model_dump(), status_code=413, headers={"connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # read inside the app: its HTTPException handler answers
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, counted, send)
