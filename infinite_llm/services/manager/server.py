"""``infinite-llm serve manager``: the global manager process (state in etcd, GlobalManager service).

The process serves only while it leads. A leader that loses leadership (its etcd session lease expired: the
process was paused or cut off from etcd longer than ``leader_ttl_s``; or another manager took the key) exits
with status 1 instead of staying up as a follower nobody routes to: its in-memory state (capacity view,
migrations in flight, reconciliation passes) belongs to the term it lost, and a fresh process (Kubernetes'
restart, ``up``'s supervision) campaigns and rebuilds it from etcd, as any new leader does. Kubernetes'
leader-elected controllers do the same (client-go's ``OnStoppedLeading``).

A **hot standby** (``--standby``) serves before it leads: it binds its port at once, reports ``""`` SERVING
(alive: Kubernetes keeps it Ready, so a rolling update proceeds) and the GlobalManager service NOT_SERVING,
refuses every GlobalManager call with UNAVAILABLE naming the leader, and campaigns every
``STANDBY_CAMPAIGN_S``. Once it leads it loads the cluster from etcd, starts its loops and reports the
service SERVING. Clients dial every manager at once (a headless Service, or ``ipv4:A,B``) with
:func:`~infinite_llm.rpc.options.serving_only`: gRPC's client-side health checking sends their calls to the
one that reports SERVING, and moves them when another does. Failover takes the old leader's session lease
(``leader_ttl_s``) after a crash, one campaign period after a graceful stop (the leader resigns).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import Unavailable
from infinite_llm.observability.metrics import ManagerMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import manager_pb2, manager_pb2_grpc
from infinite_llm.rpc.certs import ETCD_CLIENT
from infinite_llm.rpc.interceptors._wrap import wrap_handler
from infinite_llm.rpc.options import MANAGER_SERVICE, SHUTDOWN_GRACE_S
from infinite_llm.rpc.server import Service, default_interceptors, start_server
from infinite_llm.rpc.tls import FROM_PROCESS, TlsConfig, load_tls_dir, resolve
from infinite_llm.services.manager.autoscale import Autoscaler, AutoscaleSettings, KubernetesScaler
from infinite_llm.services.manager.grpc_servers import GrpcBlockServers
from infinite_llm.services.manager.leadership import NotLeader
from infinite_llm.services.manager.manager import GlobalManager, ManagerConfig
from infinite_llm.services.manager.rebalance import PLAN_INTERVAL_S
from infinite_llm.services.manager.reconcile import Reconciler
from infinite_llm.services.manager.servicer import GlobalManagerServicer
from infinite_llm.state.etcd_store import EtcdStore

log = logging.getLogger(__name__)
T = TypeVar("T")
LEADERSHIP_CHECK_S = 0.5  # how often the process checks that it still leads (seconds)
EXIT_LOST_LEADERSHIP = 1
STANDBY_CAMPAIGN_S = 0.5  # how often a standby tries to take the lead (seconds): one etcd transaction each


@dataclass(frozen=True)
class ManagerServerConfig:
    """``etcd`` is ``host:port`` of an etcd client endpoint, or ``https://host:port`` for an etcd that serves
    TLS and demands a client certificate. The manager dials such an etcd with ``etcd_tls_dir``'s
    certificate (an etcd TLS directory: ``ca.pem`` of the etcd CA, ``manager.pem``, ``manager-key.pem``;
    etcd's certificate must name the endpoint's host), else with its own identity (``--tls-dir``, for an
    etcd that trusts the cluster CA); TTLs in seconds."""

    etcd: str
    etcd_tls_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 50050
    manager_id: str = "manager-0"
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per rBlock of the cluster (members and callers must agree)
    prefix: str = "/infinite-llm/"
    member_ttl_s: int = 10
    leader_ttl_s: int = 10
    acquire_timeout_s: float = 60.0
    metrics_port: int = 0  # Prometheus /metrics (0 = off)
    shutdown_grace_s: float = SHUTDOWN_GRACE_S  # after SIGTERM, calls in flight get this long (seconds)
    autoscale: AutoscaleSettings | None = None  # scale the attention StatefulSet (in a Kubernetes pod only)
    standby: bool = False  # serve as a hot standby until leading, however long (else lead within acquire_timeout_s)

    def __post_init__(self) -> None:
        host, _, port = self.etcd.removeprefix("https://").rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"--etcd must be HOST:PORT or https://HOST:PORT (port 0 to 65535), got {self.etcd!r}")
        if self.etcd_tls_dir and not self.etcd.startswith("https://"):
            raise ValueError(f"--etcd-tls-dir needs an https://HOST:PORT --etcd endpoint, got {self.etcd!r}")

    def etcd_identity(self) -> TlsConfig | None:
        """What the manager dials etcd with: ``etcd_tls_dir``'s certificate (checking the endpoint's host
        in etcd's), else this process's identity for an ``https://`` endpoint, else nothing (plaintext).

        Raises:
            ValueError: an ``https://`` endpoint without either (``--insecure`` and no ``--etcd-tls-dir``).
            InvalidRequest: ``etcd_tls_dir`` lacks a file or holds one that is not PEM.
        """
        if self.etcd_tls_dir:
            return load_tls_dir(self.etcd_tls_dir, ETCD_CLIENT, server_name=None, flag="--etcd-tls-dir")
        if not self.etcd.startswith("https://"):
            return None
        tls = resolve(FROM_PROCESS)
        if tls is None:
            raise ValueError(f"--etcd {self.etcd} needs a certificate: give --etcd-tls-dir or --tls-dir")
        return tls

    def etcd_store(self) -> EtcdStore:
        """The manager's etcd client (over mTLS with :meth:`etcd_identity`, which may raise)."""
        host, _, port = self.etcd.removeprefix("https://").rpartition(":")
        return EtcdStore(host, int(port), prefix=self.prefix, tls=self.etcd_identity())


async def serve(config: ManagerServerConfig) -> int:
    """Lead, serve until SIGINT/SIGTERM (returns 0) or until leadership is lost (returns
    ``EXIT_LOST_LEADERSHIP``), then stop gracefully. With ``config.standby``, serve as a hot standby first
    (module docstring); a stop signal while standing by returns 0."""
    setup_tracing("manager")
    scale = config.autoscale
    scaler = None if scale is None else KubernetesScaler.in_cluster(scale.statefulset, scale.namespace)  # fail fast
    store = config.etcd_store()
    await store.connect()
    holder: list[GlobalManagerServicer] = []
    servers = GrpcBlockServers(lambda sid: holder[0].address_of(sid))
    manager = GlobalManager(
        store,
        servers,
        ManagerConfig(
            config.manager_id,
            block_size=config.block_size,
            member_ttl_s=config.member_ttl_s,
            leader_ttl_s=config.leader_ttl_s,
            settle_s=config.member_ttl_s,  # members whose leases lapsed (etcd down, a long failover) register again
        ),
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    registry = CollectorRegistry()
    reconciler = Reconciler(
        manager, manager.drains, interval_s=max(config.member_ttl_s / 4, 0.5), settle_s=config.member_ttl_s
    )
    servicer = GlobalManagerServicer(manager, ManagerMetrics(registry), reconciler.reports)
    holder.append(servicer)
    service = Service.of(manager_pb2, "GlobalManager", manager_pb2_grpc.add_GlobalManagerServicer_to_server, servicer)
    interceptors = [*default_interceptors(), LeaderOnly(manager)]
    address = f"{config.host}:{config.port}"
    server = None
    if config.standby:
        server = await start_server([service], address, interceptors=interceptors, not_serving=[service.name])
        serve_metrics(registry, config.metrics_port, config.host)
        log.info("global manager %s standing by on %s:%d; campaigning", config.manager_id, config.host, server.port)
        if not await _lead_unless_stopped(stop, manager):
            log.info("global manager %s stopped while standing by", config.manager_id)
            await server.stop(0)
            await manager.stop(resign=True)
            await store.close()
            return 0
        await server.health.set(service.name, health_pb2.HealthCheckResponse.SERVING)
    else:
        try:
            await _unless_stopped(stop, manager.start(acquire_timeout_s=config.acquire_timeout_s))
        except _Stopped:  # a stop signal while it waits for a previous leader's lease to lapse
            await manager.stop(resign=True)
            await store.close()
            return 0
        server = await start_server([service], address, interceptors=interceptors)
        serve_metrics(registry, config.metrics_port, config.host)
    reconciler.start()
    manager.rebalancer.start(PLAN_INTERVAL_S)
    log.info("global manager %s leading, listening on %s:%d", config.manager_id, config.host, server.port)
    autoscaler = None
    if scale is not None:
        autoscaler = Autoscaler(manager, manager.drains, scaler, scale)
        autoscaler.start()
        log.info(
            "scaling StatefulSet %s between %d and %d attention servers",
            scale.statefulset,
            scale.policy.min_replicas,
            scale.policy.max_replicas,
        )
    lost = not await _until_stopped_or_not_leading(stop, manager)
    if not lost:
        log.info("global manager %s stopping: finishing its calls, then resigning the lead", config.manager_id)
    else:
        log.error(
            "global manager %s lost leadership (its etcd session lapsed or another manager took over): exiting "
            "so that a fresh process campaigns and reloads the cluster state from etcd",
            config.manager_id,
        )
    await reconciler.stop()
    await manager.rebalancer.stop()
    if autoscaler is not None:
        await autoscaler.stop()
    await server.stop(0 if lost else config.shutdown_grace_s)  # calls on a manager that no longer leads fail
    await manager.stop()
    await store.close()
    return EXIT_LOST_LEADERSHIP if lost else 0


async def _lead_unless_stopped(stop: asyncio.Event, manager: GlobalManager) -> bool:
    """Start ``manager`` (load the cluster, watch members) and campaign every ``STANDBY_CAMPAIGN_S`` until it
    leads with the cluster reloaded (True) or ``stop`` is set (False). A campaign or reload that etcd fails
    is retried, not fatal: a standby outlives etcd's restarts as the leader does. Raises what starting raises
    (etcd unreachable at start)."""
    try:
        if await _unless_stopped(stop, _led(manager.start(acquire_timeout_s=0))):
            return True
        failing = False
        while True:
            await _unless_stopped(stop, asyncio.sleep(STANDBY_CAMPAIGN_S))
            try:  # a reload that failed after a won campaign is redone: the next campaign finds the key ours
                if await _unless_stopped(stop, _led(manager.acquire_leadership(0))):
                    return True
                failing = False
            except Unavailable as e:
                if not failing:
                    log.warning("global manager %s cannot campaign (%s); retrying", manager.config.manager_id, e)
                failing = True
    except _Stopped:
        return False


async def _led(attempt: Awaitable[None]) -> bool:
    """Whether ``attempt`` (one campaign, then the reload if it won) completed; False: another manager leads."""
    try:
        await attempt
    except NotLeader:
        return False
    return True


class _Stopped(Exception):
    """The stop signal came first (:func:`_unless_stopped`)."""


async def _unless_stopped(stop: asyncio.Event, attempt: Awaitable[T]) -> T:
    """``attempt``'s result, unless ``stop`` is set first: then ``attempt`` is cancelled and :class:`_Stopped`
    raised. Raises what ``attempt`` raises."""
    task = asyncio.ensure_future(attempt)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise _Stopped
    return task.result()


class LeaderOnly(grpc.aio.ServerInterceptor):
    """Refuses every GlobalManager call with UNAVAILABLE (:class:`NotLeader`, naming the leader) while this
    manager does not lead: a standby's state is not loaded, and a manager that just lost the lead exits."""

    def __init__(self, manager: GlobalManager) -> None:
        self._manager = manager

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        handler = await continuation(handler_call_details)
        if not handler_call_details.method.startswith(f"/{MANAGER_SERVICE}/"):
            return handler
        manager = self._manager

        @contextlib.asynccontextmanager
        async def leading(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            if not manager.is_leader:
                try:
                    leader = await manager.leadership.leader_id()
                except Exception as e:  # noqa: BLE001 (the refusal stands; etcd's state is only a hint)
                    leader = f"unknown ({e})"
                me = manager.config.manager_id
                raise NotLeader(f"global manager {me} is standing by; the leader is {leader or 'nobody yet'}")
            yield

        return wrap_handler(handler, leading)


async def _until_stopped_or_not_leading(stop: asyncio.Event, manager: GlobalManager) -> bool:
    """Wait for ``stop`` (True) or for ``manager`` to stop leading (False)."""
    while manager.is_leader:
        try:
            await asyncio.wait_for(stop.wait(), LEADERSHIP_CHECK_S)
            return True
        except TimeoutError:
            pass
    return stop.is_set()
