"""``infinite-llm serve manager``: the global manager process (state in etcd, GlobalManager service)."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.observability.metrics import ManagerMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import manager_pb2, manager_pb2_grpc
from infinite_llm.rpc.options import SHUTDOWN_GRACE_S
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.rpc.tls import FROM_PROCESS, resolve
from infinite_llm.services.manager.autoscale import Autoscaler, AutoscaleSettings, DrainGuard, KubernetesScaler
from infinite_llm.services.manager.grpc_servers import GrpcBlockServers
from infinite_llm.services.manager.manager import GlobalManager, ManagerConfig
from infinite_llm.services.manager.rebalance import PLAN_INTERVAL_S
from infinite_llm.services.manager.reconcile import Reconciler
from infinite_llm.services.manager.servicer import GlobalManagerServicer
from infinite_llm.state.etcd_store import EtcdStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManagerServerConfig:
    """``etcd`` is ``host:port`` of an etcd client endpoint, or ``https://host:port`` for an etcd that
    takes only clients with a certificate of the cluster CA (the manager dials it with its own identity,
    ``--tls-dir``); TTLs in seconds."""

    etcd: str
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

    def __post_init__(self) -> None:
        host, _, port = self.etcd.removeprefix("https://").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--etcd must be HOST:PORT or https://HOST:PORT, got {self.etcd!r}")

    def etcd_store(self) -> EtcdStore:
        """The manager's etcd client; over mTLS with this process's identity for an ``https://`` endpoint.
        Raises ValueError for an ``https://`` endpoint when the process has no identity (``--insecure``)."""
        host, _, port = self.etcd.removeprefix("https://").rpartition(":")
        tls = None
        if self.etcd.startswith("https://"):
            tls = resolve(FROM_PROCESS)
            if tls is None:
                raise ValueError(f"--etcd {self.etcd} needs a certificate: give --tls-dir, not --insecure")
        return EtcdStore(host, int(port), prefix=self.prefix, tls=tls)


async def serve(config: ManagerServerConfig) -> None:
    setup_tracing("manager")
    scale = config.autoscale
    scaler = None if scale is None else KubernetesScaler.in_cluster(scale.statefulset, scale.namespace)  # fail fast
    store = config.etcd_store()
    await store.connect()
    holder: list[GlobalManagerServicer] = []
    servers = GrpcBlockServers(lambda sid: holder[0].address_of(sid))
    guard = DrainGuard(servers) if scale is not None else None
    manager = GlobalManager(
        store,
        guard or servers,
        ManagerConfig(
            config.manager_id,
            block_size=config.block_size,
            member_ttl_s=config.member_ttl_s,
            leader_ttl_s=config.leader_ttl_s,
        ),
    )
    servers.on_uncached = manager.prefix.note_uncached  # evictions reported in reserve replies leave the index
    await manager.start(acquire_timeout_s=config.acquire_timeout_s)
    registry = CollectorRegistry()
    reconciler = Reconciler(
        manager, guard or servers, interval_s=max(config.member_ttl_s / 4, 0.5), settle_s=config.member_ttl_s
    )
    servicer = GlobalManagerServicer(manager, ManagerMetrics(registry), reconciler.reports)
    serve_metrics(registry, config.metrics_port, config.host)
    holder.append(servicer)
    service = Service.of(manager_pb2, "GlobalManager", manager_pb2_grpc.add_GlobalManagerServicer_to_server, servicer)
    server = await start_server([service], f"{config.host}:{config.port}")
    reconciler.start()
    manager.rebalancer.start(PLAN_INTERVAL_S)
    log.info("global manager %s leading, listening on %s:%d", config.manager_id, config.host, server.port)
    autoscaler = None
    if scale is not None:
        autoscaler = Autoscaler(manager, guard, scaler, scale)
        autoscaler.start()
        log.info(
            "scaling StatefulSet %s between %d and %d attention servers",
            scale.statefulset,
            scale.policy.min_replicas,
            scale.policy.max_replicas,
        )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await reconciler.stop()
    await manager.rebalancer.stop()
    if autoscaler is not None:
        await autoscaler.stop()
    await server.stop(config.shutdown_grace_s)
    await manager.stop()
    await store.close()
