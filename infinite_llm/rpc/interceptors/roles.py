"""Server interceptor: a call from a role the service does not admit (``rpc/access.py``) is
PERMISSION_DENIED before its handler runs.

The role comes from the caller's certificate, which the mTLS handshake already checked against the
cluster CA (``rpc/tls.py``). Installed by ``rpc/server.py`` on every server that serves TLS, inside the
error-mapping interceptor, so the refusal is a typed :class:`~infinite_llm.core.errors.PermissionDenied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Mapping

import grpc

from infinite_llm.core.errors import PermissionDenied
from infinite_llm.rpc.access import ACCESS, OPEN_SERVICES, Access, admits, split_method
from infinite_llm.rpc.interceptors._wrap import behavior_of, rebuild, wrap_handler
from infinite_llm.rpc.tls import peer_of

log = logging.getLogger(__name__)


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call only if ``table`` admits the caller's role for its method."""

    def __init__(self, table: Mapping[str, Access] = ACCESS) -> None:
        self.table = table

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if split_method(method)[0] in OPEN_SERVICES:
            return handler

        @contextlib.asynccontextmanager
        async def checked(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            peer = peer_of(context)
            if not admits(method, peer.role, self.table):
                log.warning("refused %s from %s (role %s)", method, context.peer(), peer.role)
                raise PermissionDenied(f"role {peer.role or 'none'!r} may not call {method}")
            yield

        return wrap_handler(_as_async(handler), checked)


def _as_async(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with a synchronous behaviour run in a thread from an async one, so the role check
    wraps it too (``wrap_handler`` leaves synchronous behaviours alone: fail closed instead)."""
    if handler is None:
        return None
    behavior = behavior_of(handler)
    if inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior):
        return handler
    if handler.request_streaming:

        async def refuse(request, context):
            raise PermissionDenied("synchronous request-streaming handlers are not served under TLS")

        return rebuild(handler, refuse, handler.request_deserializer)
    if handler.response_streaming:

        async def stream(request, context):
            for response in await asyncio.to_thread(lambda: list(behavior(request, context))):
                yield response

        return rebuild(handler, stream, handler.request_deserializer)

    async def unary(request, context):
        return await asyncio.to_thread(behavior, request, context)

    return rebuild(handler, unary, handler.request_deserializer)
