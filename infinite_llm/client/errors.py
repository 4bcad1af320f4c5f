"""The typed errors a failed call raises, and :func:`error_from_rpc`, which rebuilds them from a gRPC status.

The mapping itself lives in ``infinite_llm.rpc.errors`` (both directions, one place); this module is the
SDK's view of it. The SDK raises these, and so do mesh components calling each other, so a caller catches
``CapacityExhausted`` whether the engine is local or behind the router.
"""

from __future__ import annotations

from infinite_llm.core.errors import (
    Cancelled,
    CapacityExhausted,
    ContextLengthExceeded,
    DeadlineExceeded,
    FailedPrecondition,
    InfiniteLLMError,
    InvalidRequest,
    KVCapacityExceeded,
    KVMemoryLost,
    MessageTooLarge,
    ModelNotFound,
    NotFound,
    PermissionDenied,
    QueueFull,
    Unauthenticated,
    Unavailable,
)
from infinite_llm.rpc.errors import error_from_rpc

__all__ = [
    "Cancelled",
    "CapacityExhausted",
    "ContextLengthExceeded",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InfiniteLLMError",
    "InvalidRequest",
    "KVCapacityExceeded",
    "KVMemoryLost",
    "MessageTooLarge",
    "ModelNotFound",
    "NotFound",
    "PermissionDenied",
    "QueueFull",
    "Unauthenticated",
    "Unavailable",
    "error_from_rpc",
]
