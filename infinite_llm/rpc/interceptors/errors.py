"""Server interceptor: typed errors become status codes; bytes that are not the request message become
INVALID_ARGUMENT; anything unexpected becomes INTERNAL.

The one place where :class:`~infinite_llm.core.errors.InfiniteLLMError` meets a server call (STYLE.md
habit 5): :func:`~infinite_llm.rpc.errors.abort_with` sends the error's status code, message, reason and
param. A request that does not deserialize (garbage bytes, invalid UTF-8 in a string field) is the
caller's fault: gRPC alone would answer UNKNOWN. An unexpected exception is logged with its traceback
and the request id and answered with INTERNAL; the server keeps serving.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from infinite_llm.core.errors import InfiniteLLMError, InvalidRequest
from infinite_llm.rpc.errors import abort_with, status_code_of
from infinite_llm.rpc.interceptors._wrap import behavior_of, rebuild, wrap_handler
from infinite_llm.rpc.interceptors.request_id import current_request_id

log = logging.getLogger(__name__)
__all__ = ["ErrorMappingInterceptor", "map_errors", "status_code_of"]


@contextlib.asynccontextmanager
async def map_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Turn exceptions escaping a call into ``context.abort`` with the right status code."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the behaviour already chose its status
    except InfiniteLLMError as e:
        await abort_with(context, e)
    except Exception as e:
        rid = current_request_id()
        log.exception("unexpected error in a call (request id %s)", rid)
        await abort_with(context, InfiniteLLMError(f"internal error ({type(e).__name__}); request id {rid}"))


# ---- requests that do not deserialize ------------------------------------------------------------------
def _undecodable(method: str, e: Exception) -> InvalidRequest:
    return InvalidRequest(f"the request is not a valid {method} message ({type(e).__name__}: {e})"[:500])


class _Undecodable:
    """What a unary request's deserializer hands on instead of raising (gRPC would answer UNKNOWN):
    the behaviour raises ``error`` inside :func:`map_errors`."""

    def __init__(self, error: InvalidRequest) -> None:
        self.error = error


def _decode_checked(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` whose undecodable requests fail with INVALID_ARGUMENT. A streamed request's messages are
    read inside the behaviour, so its deserializer may raise; a unary request is read before."""
    decode = handler.request_deserializer
    if decode is None:
        return handler

    def deserialize(data: bytes) -> object:
        try:
            return decode(data)
        except Exception as e:  # noqa: BLE001 - whatever the parser says, the bytes were the caller's
            error = _undecodable(method, e)
            if handler.request_streaming:
                raise error from None
            return _Undecodable(error)

    behavior = behavior_of(handler)
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler  # synchronous: left to gRPC, as in wrap_handler
    if handler.request_streaming:
        return rebuild(handler, behavior, deserialize)
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                raise request.error
            async for response in behavior(request, context):
                yield response

        return rebuild(handler, stream, deserialize)

    async def call(request, context):
        if isinstance(request, _Undecodable):
            raise request.error
        return await behavior(request, context)

    return rebuild(handler, call, deserialize)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps :class:`InfiniteLLMError` to its status, undecodable requests to INVALID_ARGUMENT, unexpected
    exceptions to INTERNAL."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return wrap_handler(_decode_checked(handler, handler_call_details.method), map_errors)
