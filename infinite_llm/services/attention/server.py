"""Attention server process: config, start, serve until SIGTERM/SIGINT, graceful stop.

``infinite-llm serve attention --kv-memory 64MiB ...`` builds an :class:`AttentionServerConfig` (sizes via
``rpc.sizes.parse_size``) and calls :func:`main`. Tests and in-process meshes use :func:`start`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE, ModelConfig
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.observability.metrics import AttentionMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import attention_server_pb2, attention_server_pb2_grpc
from infinite_llm.rpc import codec
from infinite_llm.rpc.options import DEFAULT_GRACE_S
from infinite_llm.rpc.server import RpcServer, Service, start_server
from infinite_llm.rpc.sizes import format_size
from infinite_llm.services.attention.registrar import Registrar
from infinite_llm.services.attention.served_rmanager import ServedRManager
from infinite_llm.services.attention.servicer import AttentionServicer
from infinite_llm.services.attention.tensor_channels import TensorChannels

log = logging.getLogger(__name__)
KV_DTYPES = ("float32", "bfloat16", "float16")
TRANSPORTS = ("grpc", "torch")


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
        if self.transport not in TRANSPORTS:
            raise ValueError(f"AttentionServerConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        per_block = self.layout.bytes_per_block
        if self.kv_memory_bytes < per_block:
            raise ValueError(
                f"kv_memory {format_size(self.kv_memory_bytes)} holds no rBlock: one takes {format_size(per_block)}"
            )

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
        tensor channels."""
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
    """Serve until ``stop`` is set or the process gets SIGTERM/SIGINT, then stop gracefully."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
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
        )
        registrar.start()
    try:
        await stop.wait()
    finally:
        if registrar is not None:
            await registrar.stop()
        await server.stop()


def main(config: AttentionServerConfig) -> int:
    """Blocking entry point for the CLI; returns the process exit code."""
    asyncio.run(serve(config))
    return 0
