"""Typed errors <-> gRPC status, both directions: the one mapping (STYLE.md habit 5).

Server side (:func:`abort_with`, called by the error-mapping interceptor): the status code is the error's
``grpc_code`` and the details its message; the trailing metadata adds ``x-error-reason`` (the class's
``reason``, e.g. ``CONTEXT_LENGTH_EXCEEDED``) and ``x-error-param`` (its ``param``, when set).
Client side (:func:`error_from_rpc`, used by the SDK, the router, the gateway and every component that
calls another): the exact class named by the reason, with its param and message. Nobody reads the message
to learn what went wrong. A status without a reason did not come from our servicers:

- RESOURCE_EXHAUSTED then comes from gRPC itself, which refuses a message over the size limit (either
  end; ``rpc/options.MAX_MESSAGE_BYTES``): :class:`MessageTooLarge`, an INVALID_ARGUMENT, since retrying
  the same request can never help. Our own capacity errors always carry their reason.
- anything else maps by its code (:data:`_BY_CODE`), e.g. UNAVAILABLE from a refused connection.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from infinite_llm.core.errors import (
    Cancelled,
    CapacityExhausted,
    DeadlineExceeded,
    FailedPrecondition,
    InfiniteLLMError,
    InvalidRequest,
    MessageTooLarge,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    error_class,
)

ERROR_REASON_KEY = "x-error-reason"
ERROR_PARAM_KEY = "x-error-param"
MAX_DETAILS_CHARS = 2000  # status details travel in a trailer; gRPC refuses metadata past ~8 KiB

_BY_CODE: dict[grpc.StatusCode, type[InfiniteLLMError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


# ---- server side ---------------------------------------------------------------------------------------
def status_code_of(error: InfiniteLLMError) -> grpc.StatusCode:
    """``grpc.StatusCode`` named by ``error.grpc_code`` (INTERNAL for an unknown name)."""
    return getattr(grpc.StatusCode, error.grpc_code, grpc.StatusCode.INTERNAL)


def error_trailers(error: InfiniteLLMError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names ``error``'s class and param (a param that is not printable ASCII,
    which metadata cannot carry, is left out)."""
    trailers = [(ERROR_REASON_KEY, error.reason)]
    if error.param and error.param.isascii() and error.param.isprintable():
        trailers.append((ERROR_PARAM_KEY, error.param))
    return tuple(trailers)


async def abort_with(context: grpc.aio.ServicerContext, error: InfiniteLLMError) -> NoReturn:
    """End the call with ``error``: its status code, message and trailers, after any trailing metadata the
    call already set (the request id)."""
    trailers = (*(context.trailing_metadata() or ()), *error_trailers(error))
    details = error.message if len(error.message) <= MAX_DETAILS_CHARS else error.message[:MAX_DETAILS_CHARS] + "..."
    await context.abort(status_code_of(error), details, trailing_metadata=trailers)


# ---- client side ---------------------------------------------------------------------------------------
def _trailer(e: grpc.RpcError, key: str) -> str | None:
    trailing = getattr(e, "trailing_metadata", None)
    for k, v in (trailing() if callable(trailing) else None) or ():
        if k == key and isinstance(v, str):
            return v
    return None


def describe_rpc_error(e: grpc.RpcError) -> str:
    """``CODE: details`` of a failed call, for logs and the errors that quote it."""
    code = e.code()  # type: ignore[attr-defined]
    return f"{code.name if code else 'error'}: {e.details()}"  # type: ignore[attr-defined]


def error_from_rpc(e: grpc.RpcError) -> InfiniteLLMError:
    """The typed error a failed call carries (see the module docstring); ``grpc_status`` holds its code."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or code.name
    reason = _trailer(e, ERROR_REASON_KEY)
    cls = error_class(reason) if reason is not None else None
    if cls is None and reason is None and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        cls = MessageTooLarge
    if cls is None:
        cls = _BY_CODE.get(code, InfiniteLLMError)
    err = cls(details, param=_trailer(e, ERROR_PARAM_KEY))
    err.grpc_status = code  # type: ignore[attr-defined]
    return err
