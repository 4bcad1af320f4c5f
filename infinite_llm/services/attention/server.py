"""Attention server process: config, start, serve until SIGTERM/SIGINT, drain, graceful stop.

``infinite-llm serve attention --kv-memory 64MiB ...`` builds an :class:`AttentionServerConfig` (sizes via
``rpc.sizes.parse_size``) and calls :func:`main`. Tests and in-process meshes use :func:`start`.

Stopping (SIGTERM: a rolling update, a node drain, ``kubectl delete pod``) a server that holds rBlocks first
drains it (:func:`drain`): it tells the manager in a heartbeat, which places nothing new here and migrates
the running sequences' rBlocks to other servers while they decode (the planner's drain moves, as when the
autoscaler scales the pool down; PAPER.md "Managers", DESIGN.md §5). The server keeps serving their attention
and the copies until it is empty, ``drain_timeout_s`` passed, nothing left it for ``DRAIN_IDLE_S`` (the
manager has nowhere to move the rest), or a second signal; whatever is still here then is recomputed by its
compute instance, as after a crash. Only then does the gRPC server stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from prometheus_client import CollectorRegistry

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE, ModelConfig
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.observability.metrics import AttentionMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import attention_server_pb2, attention_server_pb2_grpc
from infinite_llm.rpc import codec
from infinite_llm.rpc.errors import describe_rpc_error
from infinite_llm.rpc.options import DEFAULT_GRACE_S, DRAIN_TIMEOUT_S
from infinite_llm.rpc.server import RpcServer, Service, start_server
from infinite_llm.rpc.sizes import format_size
from infinite_llm.services.attention.registrar import Registrar
from infinite_llm.services.attention.served_rmanager import ServedRManager
from infinite_llm.services.attention.servicer import AttentionServicer
from infinite_llm.services.attention.tensor_channels import TensorChannels
from infinite_llm.services.attention.types import HolderStats

log = logging.getLogger(__name__)
KV_DTYPES = ("float32", "bfloat16", "float16")
TRANSPORTS = ("grpc", "torch")
DRAIN_IDLE_S = 20.0  # a drain gives up when no rBlock left for this long (the manager has nowhere to move the rest)
DRAIN_POLL_S = 0.2


@dataclass(frozen=True)
class AttentionServerConfig:
    """Everything an attention server needs; the KV layout comes from the model's config.

    Attributes:
        kv_memory_bytes: bytes of KV memory; the server holds ``kv_memory_bytes // bytes_per_block`` rBlocks.
        num_layers / num_kv_heads / head_dim: of the served model. dtype: KV dtype name (``KV_DTYPES``).
        block_size: tokens per rBlock. host/port: where to listen (port 0 picks one). device: ``cpu``/``cuda``.
    """

    server_id: str
    kv_memory_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    block_size: int = DEFAULT_BLOCK_SIZE
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    grace_s: float = DEFAULT_GRACE_S
    manager_address: str = ""  # host:port of the global manager; empty: do not register
    metrics_port: int = 0  # Prometheus /metrics (0 = off)
    advertise_host: str = ""  # host others reach this server at (default: host)
    transport: str = "grpc"  # "torch" also accepts torch.distributed tensor channels (OpenTensorChannel)
    node_name: str = ""  # the machine it runs on: a home of the compute instances registered with that node
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # after SIGTERM: how long to wait for a drain (0: stop at once)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AttentionServerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"AttentionServerConfig.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"AttentionServerConfig.port must be in [0, 65536), got {self.port}")
        if not self.server_id:
            raise ValueError("AttentionServerConfig.server_id must not be empty")
        if self.drain_timeout_s < 0:
            raise ValueError(f"AttentionServerConfig.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"AttentionServerConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        check_kv_memory(self.kv_memory_bytes, self.layout)

    @classmethod
    def for_model(cls, model: ModelConfig, *, server_id: str, kv_memory_bytes: int, **kwargs) -> AttentionServerConfig:
        """The layout fields from ``model`` (a ``core.config.ModelConfig``); the rest as given."""
        assert model.head_dim is not None
        return cls(
            server_id=server_id,
            kv_memory_bytes=kv_memory_bytes,
            num_layers=model.num_hidden_layers,
            num_kv_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            **kwargs,
        )

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, codec.DTYPES[self.dtype])

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def check_kv_memory(kv_memory_bytes: int, layout: KVLayout) -> None:
    """Raises ``ValueError`` when ``kv_memory_bytes`` cannot hold one rBlock of ``layout``."""
    per_block = layout.bytes_per_block
    if kv_memory_bytes < per_block:
        raise ValueError(
            f"kv_memory {format_size(kv_memory_bytes)} holds no rBlock: one takes {format_size(per_block)}"
        )


@dataclass
class AttentionServer:
    """A running attention server: the gRPC server and the servicer behind it."""

    config: AttentionServerConfig
    rpc: RpcServer
    servicer: AttentionServicer

    @property
    def port(self) -> int:
        return self.rpc.port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.rpc.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop (NOT_SERVING, drain for ``grace`` seconds, default ``config.grace_s``); closes the
        tensor channels. Compute instances' AttendStreams end at their steps' ends, not at the grace's."""
        self.servicer.begin_stop()
        await self.rpc.stop(self.config.grace_s if grace is None else grace)
        self.servicer.close()


async def start(config: AttentionServerConfig) -> AttentionServer:
    """Allocate the KV memory and start serving; returns once the port is bound and SERVING."""
    holder = ServedRManager.with_capacity(config.kv_memory_bytes, config.layout, device=config.device)
    channels = TensorChannels(config.device) if config.transport == "torch" else None
    servicer = AttentionServicer(holder, config.server_id, channels)
    service = Service.of(
        attention_server_pb2,
        "AttentionServer",
        attention_server_pb2_grpc.add_AttentionServerServicer_to_server,
        servicer,
    )
    try:
        rpc = await start_server([service], config.address)
    except BaseException:
        servicer.close()
        raise
    log.info(
        "attention server %s: %d rBlocks of %s (%s) on port %d",
        config.server_id,
        holder.rm.pool.num_blocks,
        format_size(config.layout.bytes_per_block),
        torch.device(config.device),
        rpc.port,
    )
    return AttentionServer(config, rpc, servicer)


async def serve(config: AttentionServerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or the process gets SIGTERM/SIGINT, then drain (registered servers that
    hold rBlocks; a second signal cuts it short) and stop gracefully."""
    stop = stop or asyncio.Event()
    now = asyncio.Event()  # a second signal: stop without waiting for the drain
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests): rely on ``stop``
    setup_tracing("attention")
    server = await start(config)
    registry = CollectorRegistry()
    metrics = AttentionMetrics(registry, config.server_id, server.servicer.holder.stats)
    server.servicer.on_attend_step = metrics.attend_step.observe
    serve_metrics(registry, config.metrics_port, config.host)
    registrar = None
    if config.manager_address:
        advertised = f"{config.advertise_host or config.host}:{server.port}"
        registrar = Registrar(
            config.manager_address,
            config.server_id,
            advertised,
            config.block_size,
            server.servicer.holder.stats,
            node_name=config.node_name,
            occupancy=server.servicer.holder.occupancy,
            on_stalled=server.servicer.fence,
            layout=codec.kv_layout_message(server.servicer.holder.layout),
            on_refused=lambda reason: server.rpc.set_serving(reason is None),  # NOT_SERVING while refused
        )
        registrar.start()
    try:
        await stop.wait()
        # A server the manager never admitted (refused: another layout, or its id is a live server's) holds
        # nothing placed and must not tell the manager anything under that id.
        if registrar is not None and registrar.registered.is_set() and config.drain_timeout_s > 0:
            await drain(server.servicer.holder.stats, registrar, config.drain_timeout_s, now)
    finally:
        if registrar is not None:
            await registrar.stop()
            await registrar.deregister()
        log.info("stopping: calls in flight get up to %g s", config.grace_s)
        await server.stop()


async def drain(
    stats: Callable[[], HolderStats],
    registrar: Registrar,
    timeout_s: float,
    now: asyncio.Event | None = None,
    idle_s: float = DRAIN_IDLE_S,
) -> int:
    """Empty this server before it stops: announce the drain to the manager (an empty server too, so that
    nothing is placed or moved here while its lease runs out), then wait until it holds no rBlock (committed
    or reserved), ``timeout_s`` seconds passed, none left for ``idle_s`` seconds, or ``now`` is set. Returns
    the rBlocks still held (0: drained). Never raises for the manager: one that cannot be told ends the drain
    at once (its compute instances recompute what is here)."""
    held = _held(stats())
    try:
        await registrar.announce_draining()
    except grpc.RpcError as e:
        if held:
            log.warning(
                "stopping without a drain: the manager was not told (%s); %d rBlocks are lost",
                describe_rpc_error(e),
                held,
            )
        return held
    if held == 0:
        return 0
    log.info("draining: %d rBlocks here; the manager migrates them away (up to %.0f s)", held, timeout_s)
    loop = asyncio.get_running_loop()
    start = last_progress = loop.time()
    now = now or asyncio.Event()
    while held and not now.is_set():
        if loop.time() - start >= timeout_s or loop.time() - last_progress >= idle_s:
            break
        try:
            await asyncio.wait_for(now.wait(), DRAIN_POLL_S)
        except TimeoutError:
            pass
        left = _held(stats())
        if left < held:
            last_progress = loop.time()
        held = left
    waited = loop.time() - start
    if held == 0:  # moved by the planner, or freed by their sequences (finished, or preempted for want of room)
        log.info("drained in %.1f s: no rBlock left here", waited)
    else:
        why = "a second signal" if now.is_set() else f"{loop.time() - last_progress:.0f} s without a move"
        if loop.time() - start >= timeout_s:
            why = f"the drain timeout ({timeout_s:.0f} s)"
        log.warning("stopping after %.1f s of drain (%s): %d rBlocks still here are recomputed", waited, why, held)
    return held


def _held(s: HolderStats) -> int:
    return s.num_used + s.num_reserved


def main(config: AttentionServerConfig) -> int:
    """Blocking entry point for the CLI; returns the process exit code."""
    asyncio.run(serve(config))
    return 0
