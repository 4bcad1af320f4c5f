"""Typed errors of the whole system.

One small hierarchy, mapped once to gRPC status codes and HTTP statuses (by the rpc/ and gateway layers,
which read ``grpc_code`` / ``http_status`` from here). Core code raises these and nothing else for bad input
or exhausted capacity, so every caller can tell the user what went wrong and stay up.

Each class names a ``reason`` of its own (``CONTEXT_LENGTH_EXCEEDED``, ``QUEUE_FULL``...): the wire name of
the class. ``rpc/errors.py`` sends it with ``param`` beside the status code, and the receiving side rebuilds
the exact class with :func:`error_class`, so no caller ever reads a message to learn what went wrong.
"""

from __future__ import annotations

_BY_REASON: dict[str, type[InfiniteLLMError]] = {}


class InfiniteLLMError(Exception):
    """Base class. ``grpc_code`` names a ``grpc.StatusCode`` member; ``http_status`` an HTTP status;
    ``reason`` the class on the wire (every subclass that crosses a process boundary declares its own)."""

    grpc_code = "INTERNAL"
    http_status = 500
    openai_type = "server_error"
    openai_code: str | None = None
    reason = "INTERNAL"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "reason" in cls.__dict__:  # a class that declares a reason is the one rebuilt from it
            other = _BY_REASON.setdefault(cls.reason, cls)
            assert other is cls, f"reason {cls.reason!r} is taken by {other.__qualname__}"


_BY_REASON[InfiniteLLMError.reason] = InfiniteLLMError


def error_class(reason: str) -> type[InfiniteLLMError] | None:
    """The class whose ``reason`` is ``reason`` (None for a reason this process does not know)."""
    return _BY_REASON.get(reason)


class InvalidRequest(InfiniteLLMError):
    """The caller sent something malformed or out of range (bad shape, dtype, NaN, parameter)."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"
    reason = "INVALID_REQUEST"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus ``max_tokens`` is longer than the model's maximum length."""

    openai_code = "context_length_exceeded"
    reason = "CONTEXT_LENGTH_EXCEEDED"


class MessageTooLarge(InvalidRequest):
    """A gRPC message is over the size limit both ends agree on (``rpc/options.MAX_MESSAGE_BYTES``)."""

    reason = "MESSAGE_TOO_LARGE"


class NotFound(InfiniteLLMError):
    """An unknown sequence, block or model was named."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "not_found_error"
    reason = "NOT_FOUND"


class ModelNotFound(NotFound):
    """The request names a model the mesh does not serve (OpenAI: 404 ``model_not_found``)."""

    openai_type = "invalid_request_error"
    openai_code = "model_not_found"
    reason = "MODEL_NOT_FOUND"


class CapacityExhausted(InfiniteLLMError):
    """Not enough free rBlocks (or another capacity) to meet a request. Nothing was changed."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "rate_limit_error"
    reason = "CAPACITY_EXHAUSTED"


class QueueFull(CapacityExhausted):
    """A compute instance's waiting queue is full: another instance may take the request (the router
    tries the next one), and the same one may later."""

    reason = "QUEUE_FULL"


class KVCapacityExceeded(CapacityExhausted):
    """The request alone needs more rBlocks than the whole KV memory holds: retrying cannot help.

    Still RESOURCE_EXHAUSTED over gRPC; over HTTP a 400 ``context_length_exceeded`` (not a retryable 429).
    """

    http_status = 400
    openai_type = "invalid_request_error"
    openai_code = "context_length_exceeded"
    reason = "KV_CAPACITY_EXCEEDED"


class KVMemoryLost(CapacityExhausted):
    """Attention servers left after the request was admitted, and the KV memory left can no longer hold its
    tokens; it waited the scheduler's ``capacity_wait_s`` for memory to come back. The request itself is fine
    and may succeed once the cluster has its memory again (a restarted or added server).

    RESOURCE_EXHAUSTED over gRPC, so neither the SDK's retry policy (UNAVAILABLE only) nor the router (which
    tries another compute instance after UNAVAILABLE or ``QueueFull``) sends it again at once: every compute
    instance shares the same KV memory. Over HTTP a 503 ``server_error`` (the service lacks the memory now),
    not the client's 400 ``context_length_exceeded`` of ``KVCapacityExceeded``.
    """

    http_status = 503
    openai_type = "server_error"
    reason = "KV_MEMORY_LOST"


class FailedPrecondition(InfiniteLLMError):
    """The system is not in a state that allows the call (e.g. a member whose block size differs from the
    cluster's): retrying the same call cannot help until an operator changes something."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 400
    openai_type = "invalid_request_error"
    reason = "FAILED_PRECONDITION"


class PermissionDenied(InfiniteLLMError):
    """The caller is authenticated but may not make this call (its certificate's role, or the resource
    belongs to another identity)."""

    grpc_code = "PERMISSION_DENIED"
    http_status = 403
    openai_type = "permission_error"
    reason = "PERMISSION_DENIED"


class Unauthenticated(InfiniteLLMError):
    """The call carries no valid credentials (no or a wrong API key)."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    openai_type = "authentication_error"
    openai_code = "invalid_api_key"
    reason = "UNAUTHENTICATED"


class Unavailable(InfiniteLLMError):
    """A needed peer (server, manager, instance) is not reachable."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "server_error"
    reason = "UNAVAILABLE"


class DeadlineExceeded(InfiniteLLMError):
    """The request ran out of time (its deadline passed before or during a call)."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_type = "timeout_error"
    reason = "DEADLINE_EXCEEDED"


class Cancelled(InfiniteLLMError):
    """The call was cancelled (by the caller or a peer)."""

    grpc_code = "CANCELLED"
    http_status = 499
    openai_type = "server_error"
    reason = "CANCELLED"
