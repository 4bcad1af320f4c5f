"""Interceptors, one concern per module: request ids, error mapping (server), default deadlines (client)."""

from infinite_llm.rpc.interceptors.deadline import DefaultDeadlineInterceptor
from infinite_llm.rpc.interceptors.errors import ErrorMappingInterceptor
from infinite_llm.rpc.interceptors.request_id import (
    REQUEST_ID_KEY,
    RequestIdClientInterceptor,
    RequestIdInterceptor,
    current_request_id,
)

__all__ = [
    "REQUEST_ID_KEY",
    "DefaultDeadlineInterceptor",
    "ErrorMappingInterceptor",
    "RequestIdClientInterceptor",
    "RequestIdInterceptor",
    "current_request_id",
]
