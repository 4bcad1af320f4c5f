"""What a benchmark sends requests to: the router (gRPC, the SDK's ``AsyncClient``) or the REST gateway
(``POST /v1/completions`` with ``stream: true``, server-sent events read with httpx).

Both stream every request and stamp each chunk that carries output as it arrives; ``runner`` drives them,
``datasets`` cuts prompts with the ``PromptCodec`` each provides. The gateway is reached directly (no proxy
from the environment), so requests go to the given target only.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, aclosing, contextmanager
from typing import Protocol

import httpx

from infinite_llm.bench.datasets import WORDS, BenchRequest, PromptCodec, TokenCodec, WordCodec
from infinite_llm.bench.metrics import RequestRecord
from infinite_llm.client import AsyncClient, Client, InfiniteLLMError, InvalidRequest
from infinite_llm.rpc.tls import TlsConfig

PREPARE_TIMEOUT_S = 60.0
MODEL_QUERY_TIMEOUT_S = 5.0  # asking which model is served, only for the run's record (seconds)
PROBE_WORDS = 128  # words in the gateway's tokens-per-word probe: small enough for a tiny test mesh's KV


class TargetError(Exception):
    """The target cannot be used (unreachable, refuses the probe); the message says why."""


class RequestFailed(Exception):
    """One request failed; the message is what the summary groups errors by."""


class Target(Protocol):
    """A router or gateway under test: prepare prompts with ``prompt_codec``, then ``async with`` it and ``send``."""

    name: str
    address: str

    def prompt_codec(self, sample_text: str) -> AbstractContextManager[PromptCodec]:
        """The codec datasets cut prompts with (``sample_text``: the text they will be cut from)."""

    def served_model(self) -> str | None:
        """The model the run uses, for its record (None: the target does not say)."""

    async def __aenter__(self) -> Target: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def send(self, request: BenchRequest, sampling: dict, timeout_s: float) -> RequestRecord: ...


def word_sample() -> str:
    """A sample of the synthetic word list, to measure its tokens per word."""
    return " ".join(random.Random(0).choices(WORDS, k=PROBE_WORDS))


def describe_error(e: BaseException) -> str:
    """One line for the summary's error list (at most 300 characters)."""
    text = str(e) or type(e).__name__
    if not isinstance(e, RequestFailed):
        text = f"{type(e).__name__}: {text}"
    return text.replace("\n", " ")[:300]


class RouterTarget:
    """The router at ``HOST:PORT``; token-id prompts cut from the router's own ``Tokenize``."""

    name = "router"

    def __init__(
        self, address: str, model: str | None = None, api_key: str | None = None, tls: TlsConfig | None = None
    ) -> None:
        self.address = address.removeprefix("grpc://").rstrip("/")
        self.model = model
        self.api_key, self.tls = api_key, tls
        self._client: AsyncClient | None = None

    @contextmanager
    def prompt_codec(self, sample_text: str) -> Iterator[PromptCodec]:
        with Client(self.address, tls=self.tls, api_key=self.api_key) as client:

            def tokenize(text: str) -> list[int]:
                try:
                    return client.tokenize(text, add_special_tokens=False, timeout=PREPARE_TIMEOUT_S)
                except InvalidRequest as e:  # the text is more than the model could ever take: ask for less
                    raise ValueError(f"the router refuses the prompts' text: {describe_error(e)}") from e
                except InfiniteLLMError as e:
                    raise TargetError(
                        f"the router at {self.address} did not tokenize the prompts: {describe_error(e)}"
                    ) from e

            yield TokenCodec(tokenize)

    def served_model(self) -> str | None:
        """The model the requests name, else the first one the router serves (None if it does not say)."""
        if self.model:
            return self.model
        try:
            with Client(self.address, tls=self.tls, api_key=self.api_key) as client:
                return next(iter(client.list_models(timeout=MODEL_QUERY_TIMEOUT_S)), None)
        except InfiniteLLMError:
            return None

    async def __aenter__(self) -> RouterTarget:
        self._client = AsyncClient(self.address, tls=self.tls, api_key=self.api_key)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()

    async def send(self, request: BenchRequest, sampling: dict, timeout_s: float) -> RequestRecord:
        """Stream one request; raises ``RequestFailed`` or the SDK's typed error when it fails."""
        assert self._client is not None, "use the target as an async context manager"
        times, tokens, final = [], [], None
        start = time.perf_counter()
        stream = self._client.stream(
            request.prompt, max_tokens=request.max_tokens, timeout=timeout_s, model=self.model, **sampling
        )
        async with aclosing(stream):  # a cancelled benchmark cancels the call (its rBlocks are freed)
            async for chunk in stream:
                if chunk.token_ids:
                    times.append(time.perf_counter())
                    tokens.append(len(chunk.token_ids))
                if chunk.finish_reason:
                    final = chunk
        end = time.perf_counter()
        if final is None or final.finish_reason not in ("stop", "length"):
            raise RequestFailed(f"finished with {final.finish_reason if final else None!r}, not stop or length")
        return RequestRecord(
            True, start, end, final.prompt_tokens, final.completion_tokens or sum(tokens), tuple(times), tuple(tokens)
        )


def gateway_base_url(target: str) -> str:
    """``HOST:PORT``, ``http://HOST:PORT`` or ``.../v1`` -> the ``/v1`` base URL."""
    url = target if "://" in target else f"http://{target}"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for comments, other fields and blank lines."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def _http_error(reply: httpx.Response, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {reply.status_code}: {message}"


class GatewayTarget:
    """The OpenAI-compatible gateway; text prompts of words sized by a measured tokens-per-word ratio."""

    name = "gateway"

    def __init__(self, target: str, model: str | None = None, api_key: str | None = None) -> None:
        self.address = gateway_base_url(target)
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: httpx.AsyncClient | None = None

    def _body(self, prompt: str | list[int], max_tokens: int, **fields: object) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens, **({"model": self.model} if self.model else {}), **fields}

    @contextmanager
    def prompt_codec(self, sample_text: str) -> Iterator[PromptCodec]:
        """Measure tokens per word with one completion (``max_tokens=1``) of the sample's first words."""
        words = sample_text.split()[:PROBE_WORDS]
        body = self._body(" ".join(words), 1, temperature=0)
        try:
            with httpx.Client(trust_env=False, timeout=PREPARE_TIMEOUT_S, headers=self._headers) as http:
                reply = http.post(f"{self.address}/completions", json=body)
        except httpx.HTTPError as e:
            raise TargetError(f"the gateway at {self.address} does not answer: {describe_error(e)}") from e
        if reply.status_code != 200:
            raise TargetError(f"the gateway at {self.address} refused the probe: {_http_error(reply, reply.content)}")
        try:
            tokens_per_word = reply.json()["usage"]["prompt_tokens"] / len(words)
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            raise TargetError(f"the gateway at {self.address} answered the probe without usage: {e!r}") from e
        yield WordCodec(tokens_per_word)

    def served_model(self) -> str | None:
        """The model the requests name, else the first one ``GET /v1/models`` lists (None if it does not say)."""
        if self.model:
            return self.model
        try:
            with httpx.Client(trust_env=False, timeout=MODEL_QUERY_TIMEOUT_S, headers=self._headers) as http:
                reply = http.get(f"{self.address}/models")
            return reply.json()["data"][0]["id"] if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None

    async def __aenter__(self) -> GatewayTarget:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no queueing in the client
        self._http = httpx.AsyncClient(trust_env=False, headers=self._headers, limits=limits)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def send(self, request: BenchRequest, sampling: dict, timeout_s: float) -> RequestRecord:
        """Stream one completion; TTFT is the first non-empty text. Raises ``RequestFailed`` or httpx errors."""
        assert self._http is not None, "use the target as an async context manager"
        body = self._body(
            request.prompt, request.max_tokens, stream=True, stream_options={"include_usage": True}, **sampling
        )
        times, finish, usage = [], None, {}
        start = time.perf_counter()
        async with self._http.stream("POST", f"{self.address}/completions", json=body, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                raise RequestFailed(_http_error(reply, await reply.aread()))
            async for line in reply.aiter_lines():
                data = sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RequestFailed(f"stream error: {event['error'].get('message')}")
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        times.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
        end = time.perf_counter()
        if finish not in ("stop", "length"):
            raise RequestFailed(f"finished with {finish!r}, not stop or length")
        return RequestRecord(
            True,
            start,
            end,
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", len(times)),
            tuple(times),
            (1,) * len(times),
        )
