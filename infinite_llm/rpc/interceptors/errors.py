"""Server interceptor: typed errors become status codes; anything unexpected becomes INTERNAL.

The one place where :class:`~infinite_llm.core.errors.InfiniteLLMError` meets gRPC (STYLE.md habit 5):
the status code is the error's ``grpc_code``, the details its ``message``. An unexpected exception is
logged with its traceback and the request id and answered with INTERNAL; the server keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from infinite_llm.core.errors import InfiniteLLMError
from infinite_llm.rpc.interceptors._wrap import wrap_handler
from infinite_llm.rpc.interceptors.request_id import current_request_id

log = logging.getLogger(__name__)


def status_code_of(error: InfiniteLLMError) -> grpc.StatusCode:
    """``grpc.StatusCode`` named by ``error.grpc_code`` (INTERNAL for an unknown name)."""
    return getattr(grpc.StatusCode, error.grpc_code, grpc.StatusCode.INTERNAL)


@contextlib.asynccontextmanager
async def map_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Turn exceptions escaping a call into ``context.abort`` with the right status code."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the behaviour already chose its status
    except InfiniteLLMError as e:
        await context.abort(status_code_of(e), e.message)
    except Exception as e:
        rid = current_request_id()
        log.exception("unexpected error in a call (request id %s)", rid)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); request id {rid}")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps :class:`InfiniteLLMError` to its status code and unexpected exceptions to INTERNAL."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        return wrap_handler(await continuation(handler_call_details), map_errors)
