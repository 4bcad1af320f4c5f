"""``infinite-llm serve router``: the public gRPC entry (Router service, health, reflection)."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from infinite_llm.observability.metrics import RouterMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import router_pb2, router_pb2_grpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.router.servicer import RouterServicer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    compute_addresses: tuple[str, ...] = field(default_factory=tuple)
    host: str = "127.0.0.1"
    port: int = 50051
    model: str | None = None
    metrics_port: int = 0  # Prometheus /metrics (0 = off)

    def __post_init__(self) -> None:
        if not self.compute_addresses:
            raise ValueError("router needs --compute HOST:PORT (repeatable)")


def build_servicer(config: RouterConfig, metrics: RouterMetrics | None = None) -> RouterServicer:
    """The router needs the tokenizer and the model's limits, not its weights."""
    from infinite_llm.models.registry import load_model_config, load_tokenizer, resolve_model

    resolved = resolve_model(config.model)
    model_config = load_model_config(resolved)
    tokenizer = load_tokenizer(resolved, model_config)
    return RouterServicer(
        list(config.compute_addresses), resolved.name, model_config.max_position_embeddings, tokenizer, metrics
    )


async def serve(config: RouterConfig) -> None:
    setup_tracing("router")
    registry = CollectorRegistry()
    servicer = build_servicer(config, RouterMetrics(registry))
    serve_metrics(registry, config.metrics_port, config.host)
    service = Service.of(router_pb2, "Router", router_pb2_grpc.add_RouterServicer_to_server, servicer)
    server = await start_server([service], f"{config.host}:{config.port}")
    log.info("router listening on %s:%d -> %s", config.host, server.port, ", ".join(config.compute_addresses))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
