"""``infinite-llm serve router``: the public gRPC entry (Router service, health, reflection).

It sends requests to the compute instances the global manager lists (``--manager``, followed as they come
and go) and/or to static addresses (``--compute``, e.g. a headless Service as ``dns:///compute:50070``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from infinite_llm.observability.metrics import RouterMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import router_pb2, router_pb2_grpc
from infinite_llm.rpc.interceptors.api_key import ApiKeyInterceptor, check_api_key
from infinite_llm.rpc.options import SHUTDOWN_GRACE_S
from infinite_llm.rpc.server import Service, default_interceptors, start_server
from infinite_llm.services.router.discovery import DEFAULT_INTERVAL_S, ComputeDiscovery
from infinite_llm.services.router.servicer import RouterServicer

log = logging.getLogger(__name__)
END_MARGIN_S = 1.0  # a stopping router ends its streams itself this long before its grace runs out (seconds)
SHUTTING_DOWN = "the router is shutting down; send the request again (another router replica takes it)"


@dataclass(frozen=True)
class RouterConfig:
    """Where the compute instances are: listed by the manager at ``manager_address`` (re-read every
    ``discovery_interval_s`` seconds) and/or the static ``compute_addresses``. ``api_keys``: a call must
    carry ``authorization: Bearer <key>`` with one of them (none: no key needed; the gateway is exempt)."""

    compute_addresses: tuple[str, ...] = field(default_factory=tuple)
    host: str = "127.0.0.1"
    port: int = 50051
    model: str | None = None
    metrics_port: int = 0  # Prometheus /metrics (0 = off)
    manager_address: str = ""  # discover compute instances from this global manager ('' = static only)
    discovery_interval_s: float = DEFAULT_INTERVAL_S
    api_keys: tuple[str, ...] = field(default_factory=tuple)
    shutdown_grace_s: float = SHUTDOWN_GRACE_S  # after SIGTERM, streams in flight get this long (seconds)

    def __post_init__(self) -> None:
        if not self.compute_addresses and not self.manager_address:
            raise ValueError("router needs --manager HOST:PORT (discovery) or --compute HOST:PORT (repeatable)")
        if self.discovery_interval_s <= 0:
            raise ValueError(f"discovery interval must be > 0 s, got {self.discovery_interval_s}")
        for key in self.api_keys:
            check_api_key(key)


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
    discovery = None
    if config.manager_address:
        discovery = ComputeDiscovery(config.manager_address, servicer.set_discovered, config.discovery_interval_s)
        await discovery.refresh()  # the instances registered by now take requests from the first one
        discovery.start()
    interceptors = [*default_interceptors(), ApiKeyInterceptor(config.api_keys)]
    server = await start_server([service], f"{config.host}:{config.port}", interceptors=interceptors)
    targets = list(config.compute_addresses)
    if discovery is not None:
        targets.append(f"the instances {config.manager_address} lists")
    log.info("router listening on %s:%d -> %s", config.host, server.port, ", ".join(targets))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("router stopping: new requests refused, %d s for those in flight", config.shutdown_grace_s)
    stopping = asyncio.ensure_future(server.stop(config.shutdown_grace_s))
    try:  # the streams still running when the grace is nearly out are ended here, with a reason
        await asyncio.wait_for(asyncio.shield(stopping), max(config.shutdown_grace_s - END_MARGIN_S, 0.0))
    except TimeoutError:
        ended = servicer.end_in_flight(SHUTTING_DOWN)
        log.warning("router stopping: the grace ran out; %d streams in flight ended with UNAVAILABLE", ended)
        await stopping
    if discovery is not None:
        await discovery.stop()
