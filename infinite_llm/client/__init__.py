"""The SDK: sync and asyncio clients of the Router's public gRPC API.

Example::

    from infinite_llm.client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
        for chunk in client.stream("Tell me a story", max_tokens=64):
            print(chunk.text, end="", flush=True)

Failed calls raise typed errors, all subclasses of ``InfiniteLLMError`` and all importable from here (the
same classes as ``infinite_llm.client.errors``): ``InvalidRequest`` (``ContextLengthExceeded``,
``MessageTooLarge``), ``NotFound`` (``ModelNotFound``), ``CapacityExhausted`` (``QueueFull``,
``KVCapacityExceeded``, ``KVMemoryLost``), ``FailedPrecondition``, ``PermissionDenied``, ``Unauthenticated``,
``Unavailable``, ``DeadlineExceeded``, ``Cancelled``.

Sampling defaults are the engine's (``SamplingParams``): ``temperature`` 1 (sampling, as vLLM and OpenAI);
pass ``temperature=0`` for greedy output, which ``infinite-llm generate`` gives by default.
"""

from infinite_llm.client import errors
from infinite_llm.client.errors import *  # noqa: F403 (every typed error, as errors.__all__ lists them)
from infinite_llm.client.sdk import AsyncClient, Client, Completion, CompletionChunk, ModelCard

__all__ = ["AsyncClient", "Client", "Completion", "CompletionChunk", "ModelCard", *errors.__all__]  # noqa: PLE0604
