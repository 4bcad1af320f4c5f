"""Request ids: every call carries ``x-request-id`` metadata, from the caller or generated here.

Server side, the id is taken from the call's metadata (a fresh uuid4 hex when absent or malformed), held
in a context variable for the call (logs, downstream calls) and echoed in the trailing metadata, also on
errors. Client side, an outgoing call without an id inherits the current one, so an id travels
router -> compute instance -> attention servers unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from infinite_llm.rpc.interceptors._wrap import wrap_handler

REQUEST_ID_KEY = "x-request-id"
_VALID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # what we accept from a caller; anything else is replaced
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def current_request_id() -> str | None:
    """The id of the call being served (or set by :func:`use_request_id`), else ``None``."""
    return _current.get()


@contextlib.contextmanager
def use_request_id(request_id: str):
    """Make ``request_id`` current for calls made inside the block (client code outside a server call)."""
    token = _current.set(request_id)
    try:
        yield request_id
    finally:
        with contextlib.suppress(ValueError):  # a streaming handler closed from another task (its athrow runs
            _current.reset(token)  # in that task's context): the context that held the id ends with its task


def request_id_from(metadata: tuple | None) -> str:
    """The caller's valid ``x-request-id`` in ``metadata``, else a fresh uuid4 hex."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and _VALID.match(value):
            return value
    return uuid.uuid4().hex


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Server side: pick the call's request id, make it current, echo it in trailing metadata."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        request_id = request_id_from(handler_call_details.invocation_metadata)

        @contextlib.asynccontextmanager
        async def around(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            with use_request_id(request_id):
                yield

        return wrap_handler(await continuation(handler_call_details), around)


def _with_request_id(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    request_id = current_request_id()
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    if request_id is None or REQUEST_ID_KEY in metadata:
        return details
    metadata.add(REQUEST_ID_KEY, request_id)
    return details._replace(metadata=metadata)


class RequestIdClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Client side: an outgoing call without ``x-request-id`` carries the current request id."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_request_id(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_request_id(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_request_id(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_request_id(client_call_details), request_iterator)
