"""``infinite-llm serve gateway``: the OpenAI-compatible REST gateway under uvicorn, in front of the router.

The gateway loads only the model's tokenizer (chat templates are applied and prompts tokenized here) and
talks to the router over gRPC. uvicorn drains open connections on SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI

from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.rpc.interceptors.api_key import check_api_key
from infinite_llm.rpc.options import SHUTDOWN_GRACE_S
from infinite_llm.services.gateway.app import create_app
from infinite_llm.services.gateway.backend import RouterBackend
from infinite_llm.services.gateway.body_limit import MAX_REQUEST_BYTES
from infinite_llm.services.gateway.params import MAX_CHOICES_PER_REQUEST

log = logging.getLogger(__name__)
API_KEY_ENV = "INFINITE_LLM_API_KEY"


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway settings.

    ``router``: the Router's HOST:PORT. ``api_key``: required as ``Authorization: Bearer <key>`` on ``/v1``;
    None (or "") serves without one. ``model``: where the tokenizer and chat template come from; the model
    the mesh serves (None: the default model). ``special_tokens_in_messages``: parse special-token text in
    chat message content as control tokens (only for trusted callers: a user could forge a turn); off by
    default, when content is plain text as OpenAI treats it. ``max_choices_per_request``: the most choices
    (prompts x ``n``) one request may ask for, each a request in the mesh; more is a 400.
    ``max_request_bytes``: the largest request body taken, more is a 413 (0: no limit).
    """

    router: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model: str | None = None
    special_tokens_in_messages: bool = False
    ssl_certfile: str | None = None  # serve HTTPS with this certificate and key (PEM); None: HTTP
    ssl_keyfile: str | None = None
    shutdown_grace_s: float = SHUTDOWN_GRACE_S  # after SIGTERM, open streams get this long (seconds)
    max_choices_per_request: int = MAX_CHOICES_PER_REQUEST
    max_request_bytes: int = MAX_REQUEST_BYTES  # the largest request body taken (else 413; 0: no limit)

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("give both --ssl-certfile and --ssl-keyfile for HTTPS, or neither")
        host, _, port = self.router.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--router must be HOST:PORT, got {self.router!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_choices_per_request < 1:
            raise ValueError(f"--max-choices-per-request must be >= 1, got {self.max_choices_per_request}")
        if self.max_request_bytes < 0:
            raise ValueError(f"--max-request-bytes must be >= 0 (0: no limit), got {self.max_request_bytes}")
        if self.api_key == "":
            object.__setattr__(self, "api_key", None)
        if self.api_key is not None:
            check_api_key(self.api_key)


def build_app(config: GatewayConfig) -> FastAPI:
    """The app for ``config``, with the model's tokenizer loaded (no weights)."""
    from infinite_llm.models.registry import load_model_config, load_tokenizer, resolve_model

    resolved = resolve_model(config.model)
    tokenizer = load_tokenizer(resolved, load_model_config(resolved))
    return create_app(
        RouterBackend(config.router, tokenizer),
        api_key=config.api_key,
        special_tokens_in_messages=config.special_tokens_in_messages,
        max_choices_per_request=config.max_choices_per_request,
        max_request_bytes=config.max_request_bytes,
    )


async def serve(config: GatewayConfig) -> None:
    import uvicorn

    traced = setup_tracing("gateway")
    app = build_app(config)
    if traced:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="health,metrics")
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="asyncio",
            lifespan="on",
            timeout_graceful_shutdown=round(config.shutdown_grace_s),
            log_level="info",
            ssl_certfile=config.ssl_certfile,
            ssl_keyfile=config.ssl_keyfile,
        )
    )
    log.info(
        "gateway on %s://%s:%d -> router %s (API key %s)",
        "https" if config.ssl_certfile else "http",
        config.host,
        config.port,
        config.router,
        "required" if config.api_key else "not required",
    )
    await server.serve()
