"""The FastAPI application of the REST gateway: routes, API-key check, disconnect handling, SSE responses.

``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (behind the API key when one is set) and
``/health`` (open: 200 when the router answers ``ListModels``, else 503). The app holds no state of its own
beyond the ``RouterBackend``; ``server`` runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from infinite_llm.client.errors import Cancelled
from infinite_llm.core.errors import InfiniteLLMError, Unavailable
from infinite_llm.observability.metrics import LATENCY_BUCKETS
from infinite_llm.observability.tracing import REQUEST_ID_ATTRIBUTE
from infinite_llm.services.gateway import handlers
from infinite_llm.services.gateway.backend import RouterBackend, ServedModel
from infinite_llm.services.gateway.body_limit import MAX_REQUEST_BYTES, BodyLimit
from infinite_llm.services.gateway.errors import (
    AuthenticationFailed,
    MissingApiKey,
    error_body,
    error_response,
    install_error_handlers,
)
from infinite_llm.services.gateway.params import MAX_CHOICES_PER_REQUEST
from infinite_llm.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)

T = TypeVar("T")
HEALTH_TIMEOUT_S = 2.0


class EventStream(StreamingResponse):
    """``text/event-stream``; ``on_close`` runs however the response ends (done, client gone, error)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so its requests in the mesh) if the client disconnects first.

    A cancelled ``work`` has unwound before this returns: when it is a stream's ``anext()``, the stream's
    ``aclose()`` may follow at once (an async generator still unwinding refuses it with ``RuntimeError``)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: what the work raised after the client left answers nobody
    if task in done:
        return task.result()
    raise Cancelled("the client disconnected")


def require_api_key(api_key: str | None, authorization: str | None) -> None:
    """With ``api_key`` set, ``authorization`` must be ``Bearer <api_key>``: raises ``MissingApiKey`` (no
    header) or ``AuthenticationFailed`` (401 both)."""
    if api_key is None:
        return
    if not authorization:
        raise MissingApiKey("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise AuthenticationFailed("Incorrect API key provided.")


def install_api_key_check(app: FastAPI, api_key: str | None) -> None:
    """Every ``/v1`` request is checked before anything else, its body included: a caller without the key
    learns 401, never whether its JSON parsed (as OpenAI)."""
    if api_key is None:
        return

    @app.middleware("http")
    async def authenticate(request: Request, call_next):  # noqa: ANN001, ANN202
        if request.url.path == "/v1" or request.url.path.startswith("/v1/"):
            try:
                require_api_key(api_key, request.headers.get("authorization"))
            except AuthenticationFailed as e:
                return error_response(e.http_status, error_body(e))
        return await call_next(request)


async def generate(
    request: Request,
    backend: RouterBackend,
    body: CompletionRequest | ChatCompletionRequest,
    special_tokens_in_messages: bool = False,
    max_choices: int = MAX_CHOICES_PER_REQUEST,
):  # noqa: ANN201
    """Shared body of both generation endpoints."""
    try:
        return await _generate(request, backend, body, special_tokens_in_messages, max_choices)
    except InfiniteLLMError as e:
        raise _as_sent(e, body) from None


def _as_sent(e: InfiniteLLMError, body: CompletionRequest | ChatCompletionRequest) -> InfiniteLLMError:
    """``e`` naming the fields the client sent: the mesh calls the completion length ``max_tokens``, which a
    chat request may have sent as ``max_completion_tokens``."""
    if e.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        e.param, e.message = "max_completion_tokens", e.message.replace("max_tokens", "max_completion_tokens")
        e.args = (e.message,)
    return e


async def _generate(
    request: Request,
    backend: RouterBackend,
    body: CompletionRequest | ChatCompletionRequest,
    special_tokens_in_messages: bool,
    max_choices: int,
):  # noqa: ANN202
    chat = isinstance(body, ChatCompletionRequest)
    prefix = "chatcmpl" if chat else "cmpl"
    plan = await handlers.plan(backend, body, prefix, special_tokens_in_messages, max_choices)
    # the reply's x-request-id header (install_request_id), the span's attribute and the log lines name it
    request.state.request_id = plan.id
    trace.get_current_span().set_attribute(REQUEST_ID_ATTRIBUTE, plan.id)
    if not body.stream:
        outs = await until_disconnect(request, handlers.run_to_end(backend, plan))
        respond = handlers.chat_response if chat else handlers.completion_response
        return respond(plan, outs, backend.tokenizer)
    events = handlers.stream(backend, plan)
    try:
        first = await until_disconnect(request, anext(events))  # a refused request still gets its status
    except BaseException:
        await events.aclose()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = handlers.chat_chunks if chat else handlers.completion_chunks
    bodies = chunks(plan, handlers.prepend(first, events), include_usage, backend.tokenizer)
    return EventStream(handlers.sse_stream(bodies, plan.id), on_close=events.aclose)


def install_request_id(app: FastAPI) -> None:
    """A generation's reply carries its id in ``x-request-id`` (the completion's ``id``; its choices' requests
    in the mesh are ``<id>-<choice>``), whatever its status once the request was planned: what an operator
    greps the services' logs and traces for."""

    @app.middleware("http")
    async def request_id(request: Request, call_next):  # noqa: ANN001, ANN202
        response = await call_next(request)
        rid = getattr(request.state, "request_id", None)
        if rid is not None:
            response.headers["x-request-id"] = rid
        return response


def install_metrics(app: FastAPI) -> None:
    """``GET /metrics`` (Prometheus) and per-route request counts and latencies."""
    registry = CollectorRegistry()
    requests = Counter(
        "infinite_llm:gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=registry
    )
    latency = Histogram(
        "infinite_llm:gateway_request_seconds",
        "HTTP request time (streams: until headers)",
        ["route"],
        registry=registry,
        buckets=LATENCY_BUCKETS,
    )

    @app.middleware("http")
    async def count(request: Request, call_next):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        response = await call_next(request)
        # The matched route's template, never the raw path: a path parameter (a model id) would make a new
        # label per request, without bound.
        template = getattr(request.scope.get("route"), "path", "")
        if not template and response.status_code == 413 and request.url.path in getattr(app.state, "static_routes", ()):
            template = request.url.path  # a declared body over the limit, refused before routing
        route = template if template.startswith("/v1/") else "other"
        requests.labels(route=route, status=str(response.status_code)).inc()
        latency.labels(route=route).observe(time.perf_counter() - start)
        return response

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def create_app(
    backend: RouterBackend,
    api_key: str | None = None,
    special_tokens_in_messages: bool = False,
    max_choices_per_request: int = MAX_CHOICES_PER_REQUEST,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The gateway over ``backend``; ``api_key`` (None: no check) guards every ``/v1`` route.

    ``special_tokens_in_messages``: chat message content that spells a special token (``<|im_end|>``)
    becomes that control token, as before; off by default, when content is always plain text.
    ``max_choices_per_request``: the most choices (prompts x ``n``) one request may ask for (else 400).
    ``max_request_bytes``: the largest request body taken (else 413, :mod:`.body_limit`; 0: no limit)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(title="Infinite-LLM OpenAI-compatible gateway", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)  # innermost: behind the key check, metrics, ids
    install_request_id(app)
    install_api_key_check(app, api_key)
    install_metrics(app)  # outside the key check: its 401s are counted too
    started = int(time.time())
    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):  # noqa: ANN202
        return await generate(request, backend, body, max_choices=max_choices_per_request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):  # noqa: ANN202
        return await generate(request, backend, body, special_tokens_in_messages, max_choices_per_request)

    def card(c: ServedModel) -> ModelCard:
        return ModelCard(id=c.id, created=started, owned_by=c.owned_by, max_model_len=c.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card(c) for c in await backend.models(fresh=True)])

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        """One served model's card; 404 ``model_not_found`` for any other id (ids may hold ``/``)."""
        return card(await backend.model(model_id or "\0"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        try:
            await backend.models(fresh=True, timeout_s=HEALTH_TIMEOUT_S)
        except InfiniteLLMError as e:
            down = Unavailable(f"the router at {backend.router_address} does not answer ListModels: {e.message}")
            return JSONResponse(error_body(down).model_dump(), status_code=503)
        return JSONResponse({"status": "ok"})

    app.include_router(v1)
    app.state.static_routes = frozenset(r.path for r in v1.routes if "{" not in r.path)  # for the metrics' labels
    return app
