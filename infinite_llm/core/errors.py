"""Typed errors of the whole system.

One small hierarchy, mapped once to gRPC status codes and HTTP statuses (by the rpc/ and gateway layers,
which read ``grpc_code`` / ``http_status`` from here). Core code raises these and nothing else for bad input
or exhausted capacity, so every caller can tell the user what went wrong and stay up.
"""

from __future__ import annotations


class InfiniteLLMError(Exception):
    """Base class. ``grpc_code`` names a ``grpc.StatusCode`` member; ``http_status`` an HTTP status."""

    grpc_code = "INTERNAL"
    http_status = 500
    openai_type = "server_error"
    openai_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(InfiniteLLMError):
    """The caller sent something malformed or out of range (bad shape, dtype, NaN, parameter)."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus ``max_tokens`` is longer than the model's maximum length."""

    openai_code = "context_length_exceeded"


class NotFound(InfiniteLLMError):
    """An unknown sequence, block or model was named."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "not_found_error"


class CapacityExhausted(InfiniteLLMError):
    """Not enough free rBlocks (or another capacity) to meet a request. Nothing was changed."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "rate_limit_error"


RETRY_LATER = "retry later"  # ends a CapacityExhausted message for a full queue: another instance may take it
NEVER_FITS = "it can never fit"  # ends every KVCapacityExceeded message: survives a trip through gRPC status


class KVCapacityExceeded(CapacityExhausted):
    """The request alone needs more rBlocks than the whole KV memory holds: retrying cannot help.

    Still RESOURCE_EXHAUSTED over gRPC; over HTTP a 400 ``context_length_exceeded`` (not a retryable 429).
    """

    http_status = 400
    openai_type = "invalid_request_error"
    openai_code = "context_length_exceeded"


class FailedPrecondition(InfiniteLLMError):
    """The system is not in a state that allows the call (e.g. a member whose block size differs from the
    cluster's): retrying the same call cannot help until an operator changes something."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 400
    openai_type = "invalid_request_error"


class Unavailable(InfiniteLLMError):
    """A needed peer (server, manager, instance) is not reachable."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "server_error"


class DeadlineExceeded(InfiniteLLMError):
    """The request ran out of time (its deadline passed before or during a call)."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_type = "timeout_error"


class Cancelled(InfiniteLLMError):
    """The call was cancelled (by the caller or a peer)."""

    grpc_code = "CANCELLED"
    http_status = 499
    openai_type = "server_error"
