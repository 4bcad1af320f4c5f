"""Run a server method's behaviour inside an async context manager, whatever its streaming kind.

``grpc.aio`` server interceptors only see handlers; to act around each call (set a context variable,
translate exceptions) they must rebuild the handler with a wrapped behaviour. This does it once for the
four kinds, keeping async generators async generators (streamed responses) and coroutines coroutines.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import grpc

Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]

_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def wrap_handler(handler: grpc.RpcMethodHandler | None, around: Around) -> grpc.RpcMethodHandler | None:
    """``handler`` with each call of its behaviour run inside ``around(context)``.

    Synchronous behaviours (run by grpc in a thread pool) are returned unchanged.
    """
    if handler is None:
        return None
    for kind, factory in _FACTORIES.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return factory(
                _wrap(behavior, around),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable:
    """The behaviour of ``handler``, whatever its streaming kind."""
    return next(getattr(handler, kind) for kind in _FACTORIES if getattr(handler, kind) is not None)


def rebuild(
    handler: grpc.RpcMethodHandler, behavior: Callable, request_deserializer: Callable | None
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind and response serializer with another behaviour and deserializer."""
    kind = next(kind for kind in _FACTORIES if getattr(handler, kind) is not None)
    return _FACTORIES[kind](
        behavior, request_deserializer=request_deserializer, response_serializer=handler.response_serializer
    )


def _wrap(behavior: Callable, around: Around) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            async with around(context):
                async for response in behavior(request, context):
                    yield response

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request, context):
            async with around(context):
                return await behavior(request, context)

        return call
    return behavior
