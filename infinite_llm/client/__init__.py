"""The SDK: sync and asyncio clients of the Router's public gRPC API.

Example::

    from infinite_llm.client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
        for chunk in client.stream("Tell me a story", max_tokens=64):
            print(chunk.text, end="", flush=True)

Failed calls raise typed errors (``InvalidRequest``, ``NotFound``, ``CapacityExhausted``, ``Unavailable``,
``DeadlineExceeded``), all subclasses of ``InfiniteLLMError``.
"""

from infinite_llm.client.errors import Cancelled, DeadlineExceeded, error_from_rpc
from infinite_llm.client.sdk import AsyncClient, Client, Completion, CompletionChunk
from infinite_llm.core.errors import CapacityExhausted, InfiniteLLMError, InvalidRequest, NotFound, Unavailable

__all__ = [
    "AsyncClient",
    "Cancelled",
    "CapacityExhausted",
    "Client",
    "Completion",
    "CompletionChunk",
    "DeadlineExceeded",
    "InfiniteLLMError",
    "InvalidRequest",
    "NotFound",
    "Unavailable",
    "error_from_rpc",
]
