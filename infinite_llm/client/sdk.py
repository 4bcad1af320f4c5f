"""Sync and asyncio clients of the Router (``infinite_llm.v1.Router``).

Both take the same keyword arguments as :class:`infinite_llm.core.sampling.SamplingParams` (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``,
``prompt_logprobs``) and a ``timeout`` in seconds for the whole call. A prompt is text or a list of token ids.
``logprobs=k`` returns each new token's log-probability with its ``k`` most likely alternatives;
``prompt_logprobs=k`` the same for the prompt's tokens (``max_tokens=0`` then scores a prompt alone).
Also ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias`` ({token id: bias}),
``min_tokens`` and ``json_schema`` (JSON text of a schema the output must match), as in ``SamplingParams``.

Security: ``tls`` is a :class:`~infinite_llm.rpc.tls.TlsConfig`, a TLS directory (its ``client`` files), or
by default the process's identity, else ``$INFINITE_LLM_TLS_DIR``, else plaintext; ``api_key`` travels as
``authorization: Bearer <key>`` on every call (TLS only: a key is never sent in clear).

Retries: ``max_retries`` (default 2, at most 4) resends a call that ended UNAVAILABLE before the router
answered anything: the router down or restarting, a draining router refusing new requests, a connection
refused. gRPC's own retry policy does it (``grpc.service_config``, gRFC A6), with exponential backoff
(waits of about 0.5 s, 1 s, 2 s, 4 s, each +-20% in grpcio 1.85) within the call's ``timeout`` (one that
passes while the call waits to be resent ends DEADLINE_EXCEEDED, :class:`DeadlineExceeded`): once the
router has sent its first message (a stream's first tokens) a call is never resent, so no token is produced
twice. A request over ``RETRY_BUFFER_BYTES`` (16 MiB: ~4M tokens as ids) is sent once. Other errors are
never retried: a request the router refused for its content or for capacity fails the same way again.
``max_retries=0`` sets no retry policy (gRPC still resends, as always, a call that never left the client).
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from infinite_llm.client.errors import InfiniteLLMError, InvalidRequest, MessageTooLarge, Unavailable, error_from_rpc
from infinite_llm.core.logprobs import TokenLogprob
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.options import MAX_MESSAGE_BYTES, channel_options, check_target
from infinite_llm.rpc.tls import FROM_PROCESS, TlsArg, client_tls
from infinite_llm.services.generate_codec import logprob_from_proto, sampling_to_proto

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_RETRIES = 2
MAX_RETRIES = 4  # gRPC caps a retry policy at 5 attempts
RETRY_BUFFER_BYTES = 16 << 20  # a request up to this size stays retryable (gRPC's default: 256 KiB)


@dataclass
class CompletionChunk:
    """One streamed message: new tokens and text; the last one has ``finish_reason`` and usage."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    placement: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel to token_ids (logprobs asked)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (first message)


Completion = CompletionChunk  # a unary reply carries every token, the whole text and the usage


def _chunk(msg: gpb.GenerateResponse) -> CompletionChunk:
    return CompletionChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=msg.finish_reason or None,
        prompt_tokens=msg.usage.prompt_tokens,
        completion_tokens=msg.usage.completion_tokens,
        placement={p.server_id: p.num_blocks for p in msg.placement},
        num_preemptions=msg.num_preemptions,
        logprobs=[logprob_from_proto(lp) for lp in msg.logprobs],
        prompt_logprobs=[logprob_from_proto(lp) for lp in msg.prompt_logprobs],
    )


SAMPLING_NAMES = tuple(inspect.signature(sampling_to_proto).parameters)  # the keywords generate/stream take


def _holding(text: object, **fields: object) -> str | None:
    """The name of the field whose value is, or holds, ``text`` (the string protobuf could not encode)."""
    for name, value in fields.items():
        if value is text or (isinstance(value, (list, tuple)) and any(v is text for v in value)):
            return name
    return None


def _request(prompt: str | list[int], request_id: str | None, model: str | None, **sampling) -> gpb.GenerateRequest:
    """The message of one request. Raises ``InvalidRequest`` for text that is not valid Unicode (a lone
    UTF-16 surrogate: protobuf strings are UTF-8) and ``MessageTooLarge`` past the gRPC message limit."""
    unknown = [name for name in sampling if name not in SAMPLING_NAMES]
    if unknown:  # what Python says of any unknown keyword, naming the SDK's method, not the encoder's
        close = difflib.get_close_matches(unknown[0], SAMPLING_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (sampling parameters: {', '.join(SAMPLING_NAMES)})"
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}{hint}")
    try:
        req = gpb.GenerateRequest(
            request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
            model=model or "",
            sampling=sampling_to_proto(**sampling),
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"the request holds text that is not valid Unicode: {e.reason} ({e.object[e.start : e.end]!r})",
            param=_holding(e.object, prompt=prompt, model=model, request_id=request_id, **sampling),
        ) from None
    if req.ByteSize() > MAX_MESSAGE_BYTES:  # gRPC would refuse it with RESOURCE_EXHAUSTED, as if the mesh were full
        raise MessageTooLarge(
            f"the request is {req.ByteSize()} bytes, over the {MAX_MESSAGE_BYTES}-byte gRPC message limit; "
            "no model context is that long",
            param="prompt",
        )
    return req


def _timeout(timeout: float) -> float:
    """``timeout`` (seconds) once checked: a non-positive or non-finite one would reach gRPC as a deadline
    already past (DEADLINE_EXCEEDED, as if the mesh were slow) or none at all. Raises ``InvalidRequest``."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise InvalidRequest(f"timeout must be a positive, finite number of seconds, got {timeout!r}", param="timeout")
    return float(timeout)


def retry_options(max_retries: int) -> list[tuple[str, int | str]]:
    """Channel options that resend a Router call ended UNAVAILABLE before any response, ``max_retries``
    times at most (gRFC A6 retry policy; see the module docstring). Raises ``InvalidRequest`` outside
    ``0..MAX_RETRIES``."""
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= MAX_RETRIES:
        raise InvalidRequest(
            f"max_retries must be an integer from 0 to {MAX_RETRIES}, got {max_retries!r}", param="max_retries"
        )
    if max_retries == 0:
        return []
    policy = {
        "maxAttempts": max_retries + 1,
        "initialBackoff": "0.5s",
        "maxBackoff": "4s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config = {"methodConfig": [{"name": [{"service": "infinite_llm.v1.Router"}], "retryPolicy": policy}]}
    return [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(config)),
        ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
    ]


def _credentials(
    tls: TlsArg | str | Path, api_key: str | None, max_retries: int
) -> tuple[grpc.ChannelCredentials | None, list]:
    """Channel credentials (None: plaintext) and options for ``tls``, ``api_key`` and ``max_retries``."""
    retries = retry_options(max_retries)
    identity = client_tls(tls)
    if identity is None:
        if api_key:
            raise InvalidRequest("an API key needs TLS (it would travel in clear): give tls", param="api_key")
        return None, [*channel_options(), *retries]
    credentials = identity.channel_credentials()
    if api_key:
        credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(api_key))
    return credentials, [*channel_options(), *identity.channel_options(), *retries]


@dataclass(frozen=True)
class ModelCard:
    """A model the router serves: ``id``, ``max_model_len`` (prompt + completion, tokens), ``owned_by``."""

    id: str
    max_model_len: int
    owned_by: str


def _cards(reply: rpb.ListModelsResponse) -> list[ModelCard]:
    return [ModelCard(m.id, m.max_model_len, m.owned_by) for m in reply.models]


class _RouterChannel:
    """The channel and Router stub both clients open: ``grpc`` (blocking) or ``grpc.aio`` (``_grpc``)."""

    _grpc = grpc

    def __init__(
        self,
        target: str,
        *,
        tls: TlsArg | str | Path = FROM_PROCESS,
        api_key: str | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        try:
            check_target(target)
        except ValueError as e:
            raise InvalidRequest(str(e), param="target") from None
        credentials, options = _credentials(tls, api_key, max_retries)
        self._plaintext = credentials is None
        if credentials is None:
            self._channel = self._grpc.insecure_channel(target, options=options)
        else:
            self._channel = self._grpc.secure_channel(target, credentials, options=options)
        self._stub = rgrpc.RouterStub(self._channel)

    def _error(self, e: grpc.RpcError) -> InfiniteLLMError:
        """The typed error of a failed call; a plaintext channel the server closed at once gets a hint: a
        mesh serves mTLS by default, and gRPC reports a plaintext client's refused handshake this way."""
        err = error_from_rpc(e)
        if self._plaintext and isinstance(err, Unavailable) and "Socket closed" in err.message:
            err.message += (
                " (this client speaks plaintext: if the router serves mTLS, as `infinite-llm up` and the "
                "manifests do, give tls= a TLS directory or set INFINITE_LLM_TLS_DIR)"
            )
            err.args = (err.message,)
        return err


class Client(_RouterChannel):
    """Blocking client. Use as a context manager or call :meth:`close`."""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> Completion:
        try:
            return _chunk(
                self._stub.Generate(
                    _request(prompt, request_id, model, max_tokens=max_tokens, **sampling), timeout=_timeout(timeout)
                )
            )
        except grpc.RpcError as e:
            raise self._error(e) from None

    def stream(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> Iterator[CompletionChunk]:
        """Yield chunks as they come; closing the iterator early cancels the request (its rBlocks are freed)."""
        call = self._stub.GenerateStream(
            _request(prompt, request_id, model, max_tokens=max_tokens, **sampling), timeout=_timeout(timeout)
        )
        try:
            for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()

    def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        try:
            return self._stub.Abort(gpb.AbortRequest(request_id=request_id), timeout=_timeout(timeout)).aborted
        except grpc.RpcError as e:
            raise self._error(e) from None

    def list_models(self, timeout: float = 10.0) -> list[str]:
        return [card.id for card in self.model_cards(timeout)]

    def model_cards(self, timeout: float = 10.0) -> list[ModelCard]:
        """The served models with their context length (``ListModels``)."""
        try:
            return _cards(self._stub.ListModels(rpb.ListModelsRequest(), timeout=_timeout(timeout)))
        except grpc.RpcError as e:
            raise self._error(e) from None

    def tokenize(self, text: str, add_special_tokens: bool = True, timeout: float = 10.0) -> list[int]:
        try:
            req = rpb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
            return list(self._stub.Tokenize(req, timeout=_timeout(timeout)).token_ids)
        except grpc.RpcError as e:
            raise self._error(e) from None


class AsyncClient(_RouterChannel):
    """asyncio client (``grpc.aio``); same methods as :class:`Client`, awaitable."""

    _grpc = grpc.aio

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> Completion:
        try:
            req = _request(prompt, request_id, model, max_tokens=max_tokens, **sampling)
            return _chunk(await self._stub.Generate(req, timeout=_timeout(timeout)))
        except grpc.RpcError as e:
            raise self._error(e) from None

    async def stream(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_id: str | None = None,
        model: str | None = None,
        **sampling,
    ) -> AsyncIterator[CompletionChunk]:
        call = self._stub.GenerateStream(
            _request(prompt, request_id, model, max_tokens=max_tokens, **sampling), timeout=_timeout(timeout)
        )
        try:
            async for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()

    async def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        try:
            return (await self._stub.Abort(gpb.AbortRequest(request_id=request_id), timeout=_timeout(timeout))).aborted
        except grpc.RpcError as e:
            raise self._error(e) from None

    async def list_models(self, timeout: float = 10.0) -> list[str]:
        return [card.id for card in await self.model_cards(timeout)]

    async def model_cards(self, timeout: float = 10.0) -> list[ModelCard]:
        """The served models with their context length (``ListModels``)."""
        try:
            return _cards(await self._stub.ListModels(rpb.ListModelsRequest(), timeout=_timeout(timeout)))
        except grpc.RpcError as e:
            raise self._error(e) from None
