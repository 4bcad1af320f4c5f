"""gRPC status -> typed error, the one client-side mapping (the server side maps ``grpc_code`` back).

The SDK raises these, and so do mesh components calling each other, so a caller catches
``CapacityExhausted`` whether the engine is local or behind the router.
"""

from __future__ import annotations

import grpc

from infinite_llm.core.errors import (
    Cancelled,
    CapacityExhausted,
    DeadlineExceeded,
    FailedPrecondition,
    InfiniteLLMError,
    InvalidRequest,
    NotFound,
    Unavailable,
)

_BY_CODE: dict[grpc.StatusCode, type[InfiniteLLMError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_from_rpc(e: grpc.RpcError) -> InfiniteLLMError:
    """The typed error for a failed call; unknown codes become the base ``InfiniteLLMError``."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    cls = _BY_CODE.get(code, InfiniteLLMError)
    err = cls(details or code.name)
    err.grpc_status = code  # type: ignore[attr-defined]
    return err
