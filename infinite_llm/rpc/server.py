"""The common ``grpc.aio`` server: options, interceptors, health and reflection, graceful stop.

Every service process starts its servicers through :func:`start_server`, so each one answers the
standard ``grpc.health.v1.Health`` (SERVING for ``""`` and every service; NOT_SERVING once stopping, which
Kubernetes' gRPC probes read) and server reflection (``grpcurl list``), and runs the request-id and
error-mapping interceptors (``rpc/interceptors/``) in that order. With TLS (the process's identity unless
``tls`` says otherwise, ``rpc/tls.py``) the port demands a client certificate from the cluster CA and the
role interceptor admits only the roles of ``rpc/access.py``; ``tls=None`` serves plaintext. Kubernetes'
gRPC probes cannot present a certificate: with the process's identity, a plaintext port that serves only
the same health service can be set with it (``serve ... --health-port``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from infinite_llm.core.errors import Unavailable
from infinite_llm.rpc.interceptors import ErrorMappingInterceptor, RequestIdInterceptor
from infinite_llm.rpc.interceptors.roles import RoleInterceptor
from infinite_llm.rpc.options import DEFAULT_GRACE_S, server_options
from infinite_llm.rpc.tls import FROM_PROCESS, TlsArg, TlsConfig, resolve, take_process_health_port

log = logging.getLogger(__name__)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # grpc.health.v1.Health


@dataclass(frozen=True)
class Service:
    """A servicer to serve: its full proto name and the generated ``add_..._to_server`` bound to it."""

    name: str
    register: Callable[[grpc.aio.Server], None]

    @classmethod
    def of(cls, pb2: ModuleType, service: str, add_to_server: Callable, servicer: object) -> Service:
        """``Service.of(attention_server_pb2, "AttentionServer", add_AttentionServerServicer_to_server, s)``."""
        name = pb2.DESCRIPTOR.services_by_name[service].full_name
        return cls(name, lambda server: add_to_server(servicer, server))


@dataclass
class RpcServer:
    """A started server. ``port`` is the bound port (useful with port 0)."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    health_server: grpc.aio.Server | None = None  # plaintext, health only (kubelet probes), with TLS

    async def stop(self, grace: float | None = DEFAULT_GRACE_S) -> None:
        """Report NOT_SERVING, refuse new calls, give in-flight calls ``grace`` seconds, then cancel them."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)

    async def set_serving(self, serving: bool) -> None:
        """Report ``""`` and every service served here SERVING or NOT_SERVING (a member the global manager
        refuses to register: Kubernetes' readiness probes and health-checking clients pass it by). No effect
        once stopping: a stopping server stays NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *(n for n in self.service_names if n != HEALTH_SERVICE)):
            await self.health.set(name, status)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def default_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Every server's interceptors (request ids, error mapping); a service that needs more appends its own."""
    return [RequestIdInterceptor(), ErrorMappingInterceptor()]


async def start_server(
    services: Sequence[Service],
    address: str = "127.0.0.1:0",
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
    tls: TlsArg = FROM_PROCESS,
    not_serving: Sequence[str] = (),
) -> RpcServer:
    """Build, bind (``host:port``; port 0 picks a free one) and start a server for ``services``, with mTLS
    and role checks when ``tls`` (default: the process's identity) is set.

    Health reports SERVING for ``""`` and every service but those named in ``not_serving`` (full service
    names: a hot standby's, until it leads), which report NOT_SERVING until ``health.set`` says otherwise.

    Raises:
        Unavailable: the address cannot be bound.
    """
    identity = resolve(tls)
    if interceptors is None:
        interceptors = default_interceptors()
    if identity is not None:
        interceptors = [*interceptors, RoleInterceptor()]
    server = grpc.aio.server(interceptors=list(interceptors), options=server_options())
    for service in services:
        service.register(server)
    health = _add_health(server)
    names = (*(s.name for s in services), HEALTH_SERVICE)
    reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
    port = _bind(server, address, identity)
    await server.start()
    health_server = None
    if identity is not None and tls is FROM_PROCESS and (health_port := take_process_health_port()):
        health_server = await _start_health_only(health, f"{address.rpartition(':')[0]}:{health_port}")
    for name in ("", *(s.name for s in services)):
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if name in not_serving
            else health_pb2.HealthCheckResponse.SERVING
        )
        await health.set(name, status)
    security = f"mTLS as {identity.role}" if identity is not None else "plaintext"
    log.info("serving %s on %s (port %d, %s)", ", ".join(s.name for s in services), address, port, security)
    return RpcServer(server, health, port, names, health_server)


async def _start_health_only(health: health_aio.HealthServicer, address: str) -> grpc.aio.Server:
    """A plaintext server answering only ``grpc.health.v1`` from ``health`` (the TLS server's statuses)."""
    server = grpc.aio.server(options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _bind(server, address, None)
    await server.start()
    log.info("plaintext health checks (grpc.health.v1 only) on %s", address)
    return server


class HealthServicer(health_aio.HealthServicer):
    """grpcio-health-checking's asyncio servicer with ``Watch`` as an async generator.

    Its own ``Watch`` is a coroutine that writes to its context; a server interceptor that iterates a
    server-streaming handler's responses (OpenTelemetry's aio server instrumentation does) fails it with a
    TypeError, and gRPC's client-side health checking, which rides ``Watch``
    (``rpc/options.py::serving_only``), then sees every backend unhealthy. Same protocol and states (the
    library's, read through its attributes): the current status first, then each change; statuses that
    change faster than the peer reads may be skipped (only the eventual one matters).
    """

    async def Watch(self, request: health_pb2.HealthCheckRequest, context):  # noqa: ANN001, ANN201, N802
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        last = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last:
                        yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                    await condition.wait()
        finally:
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]


def _add_health(server: grpc.aio.Server) -> HealthServicer:
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return health


def _bind(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as e:
        raise Unavailable(f"cannot bind {address}: {e}") from e
    if port == 0:
        raise Unavailable(f"cannot bind {address}")
    return port
