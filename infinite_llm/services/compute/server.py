"""``infinite-llm serve compute``: a compute instance process.

Loads the model's dense layers, runs the engine on its own thread with a remote :class:`DistAttention` as the KV backend
(attention on the attention servers, placement by the global manager), and serves ``ComputeInstance``. Once
serving, it registers with the manager (address, home attention servers) and heartbeats its load, which is
how routers find it; a graceful stop deregisters before draining.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE, ModelConfig
from infinite_llm.core.dist_attention import DistAttention
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.ids import check_id
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.observability.metrics import EngineMetrics, serve_metrics
from infinite_llm.observability.tracing import setup_tracing
from infinite_llm.pb.v1 import compute_instance_pb2, compute_instance_pb2_grpc, tensor_pb2
from infinite_llm.rpc import codec
from infinite_llm.rpc.options import SHUTDOWN_GRACE_S
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.compute.engine_loop import EngineLoop
from infinite_llm.services.compute.migration import MigrationExecutor
from infinite_llm.services.compute.registrar import ComputeLoadReport, ComputeRegistrar
from infinite_llm.services.compute.remote_kv import TRANSPORTS, remote_dist_attention
from infinite_llm.services.compute.servicer import ComputeInstanceServicer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComputeConfig:
    """Where to listen, whom to ask for placement, what model to run, and the scheduler's limits."""

    manager_address: str
    host: str = "127.0.0.1"
    port: int = 0
    instance_id: str = "compute-0"
    model: str | None = None
    dtype: torch.dtype = torch.float32
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    rpc_timeout_s: float = 30.0
    metrics_port: int = 0  # Prometheus /metrics (0 = off)
    device: str = "cpu"  # where the dense layers run: cpu, cuda or cuda:N
    max_waiting: int = 1024  # queued requests before new ones get RESOURCE_EXHAUSTED (backpressure)
    transport: str = "grpc"  # how attention tensors travel: grpc, or torch (torch.distributed, gRPC control)
    home_server_ids: tuple[str, ...] = ()  # attention servers on this instance's node, by server id
    node_name: str = ""  # this instance's node: attention servers registered with it are homes too
    advertise_host: str = ""  # host the router reaches this instance at (default: host)
    migration_tokens_per_step: int = 16  # KV tokens a live migration moves between two steps (0 = refuse orders)
    drain_tokens_per_step: int = 256  # ... when its source is draining (a server stopping must empty in time)
    enable_prefix_caching: bool = True  # share full prompt rBlocks across the cluster (--no-prefix-caching: off)
    # rBlocks a running sequence asks the manager for beyond its need, so a decode crosses 3 block
    # boundaries per Place round trip instead of 1 (SchedulerConfig.placement_lookahead_blocks)
    placement_lookahead_blocks: int = 2
    shutdown_grace_s: float = SHUTDOWN_GRACE_S  # after SIGTERM, requests in flight get this long (seconds)

    def __post_init__(self) -> None:
        if not self.manager_address:
            raise ValueError("compute instance needs --manager HOST:PORT")
        try:
            check_id("instance_id", self.instance_id)
            for server_id in self.home_server_ids:
                check_id("home", server_id)
            if self.node_name:
                check_id("node_name", self.node_name)
        except InvalidRequest as e:
            raise ValueError(e.message) from None
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.placement_lookahead_blocks < 0:
            raise ValueError(f"--placement-lookahead-blocks must be >= 0, got {self.placement_lookahead_blocks}")


def build_engine(
    config: ComputeConfig, on_rpc: Callable[[str, float], None] | None = None
) -> tuple[LLMEngine, DistAttention, str]:
    """Load the model and wire its attention to the cluster; returns (engine, kv backend, model name)."""
    from infinite_llm.models.registry import load_model_files, resolve_model

    resolved = resolve_model(config.model)
    model_config, state_dict, tokenizer = load_model_files(resolved, config.dtype)
    model_id = prefix_cache_model_id(resolved.name, config.dtype) if config.enable_prefix_caching else None
    kv = remote_dist_attention(
        config.manager_address,
        config.block_size,
        device=config.device,
        timeout_s=config.rpc_timeout_s,
        transport=config.transport,
        on_rpc=on_rpc,
        instance_id=config.instance_id,
        prefix_cache_model_id=model_id,
    )
    kv.placement.check_cluster(kv_layout(model_config, config))
    engine_config = EngineConfig(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        dtype=config.dtype,
        device=config.device,
        placement_lookahead_blocks=config.placement_lookahead_blocks,
    )
    engine = LLMEngine.from_weights(model_config, state_dict, tokenizer, engine_config, kv=kv)
    return engine, kv, resolved.name


def kv_layout(model_config: ModelConfig, config: ComputeConfig) -> KVLayout:
    """The KV this instance's model and dtype need on every attention server."""
    return KVLayout(
        num_layers=model_config.num_hidden_layers,
        block_size=config.block_size,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=config.dtype,
    )


def prefix_cache_model_id(model_name: str, dtype: torch.dtype) -> str:
    """The model's identity in the cluster's prefix-cache block hashes: instances serving the same weights in
    the same dtype share cached rBlocks; any other pair never does (their KV differs)."""
    return f"{model_name}:{str(dtype).removeprefix('torch.')}"


async def serve(config: ComputeConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM, then drain gracefully."""
    setup_tracing("compute")
    registry = CollectorRegistry()
    rpc_hist: list = []
    engine, kv, model_name = build_engine(config, on_rpc=lambda s, t: rpc_hist[0].labels(server_id=s).observe(t))
    loop = EngineLoop(engine, max_waiting=config.max_waiting)
    metrics = EngineMetrics(
        registry,
        lambda: loop.num_running,
        lambda: loop.num_waiting,
        lambda: engine.num_preemptions,
        lambda: (kv.prefix_cache_queries, kv.prefix_cache_hits),
    )
    rpc_hist.append(metrics.attention_rpc)
    loop.metrics = metrics
    serve_metrics(registry, config.metrics_port, config.host)
    loop.start()
    servicer = ComputeInstanceServicer(loop, config.instance_id, model_name, kv=kv)
    service = Service.of(
        compute_instance_pb2,
        "ComputeInstance",
        compute_instance_pb2_grpc.add_ComputeInstanceServicer_to_server,
        servicer,
    )
    server = await start_server([service], f"{config.host}:{config.port}")
    log.info("compute instance %s serving %s on %s:%d", config.instance_id, model_name, config.host, server.port)
    print(f"compute instance {config.instance_id} listening on {config.host}:{server.port}", flush=True)
    layout = kv_layout(engine.model_config, config)
    registrar = registrar_for(config, server.port, loop, kv.placement.held_seq_ids, codec.kv_layout_message(layout),
                              on_refused=lambda reason: server.set_serving(reason is None),
                              claimed=kv.placement.claimed_seq_ids)  # fmt: skip
    migrations = migration_executor(loop, kv, config) if config.migration_tokens_per_step > 0 else None
    registrar.migrations = migrations
    registrar.start()
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await registrar.stop()  # routers stop sending new requests; the running ones drain below
    await server.stop(config.shutdown_grace_s)
    loop.stop()
    if migrations is not None:
        migrations.close()
    close_transport = getattr(kv.transport, "close", None)
    if close_transport is not None:  # the attention servers' streams end OK, not cancelled with this process
        close_transport()


def migration_executor(loop: EngineLoop, kv: DistAttention, config: ComputeConfig) -> MigrationExecutor:
    """Live migrations of this instance's sequences, run by ``loop`` between its steps."""

    def computed(seq_id: str) -> int | None:
        return next((s.num_computed_tokens for s in loop.engine.scheduler.running[:] if s.seq_id == seq_id), None)

    def paced(moving_s: float, stepping_s: float) -> None:
        if loop.metrics is not None:
            loop.metrics.migration_seconds.inc(moving_s)
            loop.metrics.migration_step_seconds.inc(stepping_s)
            if stepping_s > 0:  # one step ran between two calls that worked on an order
                loop.metrics.migration_steps.inc()

    executor = MigrationExecutor(
        kv, computed, config.migration_tokens_per_step, config.rpc_timeout_s, paced, config.drain_tokens_per_step
    )
    loop.between_steps = executor.between_steps
    loop.when_idle = executor.settle_idle  # an order whose sequence ended settles without waiting for a step
    executor.on_offer = loop.wake
    return executor


def registrar_for(
    config: ComputeConfig,
    port: int,
    loop: EngineLoop,
    held: Callable[[], list[str]] | None = None,
    layout: tensor_pb2.KVLayout | None = None,
    on_refused: Callable[[str | None], Awaitable[None]] | None = None,
    claimed: Callable[[], list[str]] | None = None,
) -> ComputeRegistrar:
    """The instance's membership: its advertised ``host:port``, homes, the KV it needs (``layout``), and its
    loop's load on heartbeats (``held()``: the sequences it holds rBlocks for, for the manager's orphan
    reconciliation). ``on_refused``: as for :class:`ComputeRegistrar` (the server reports NOT_SERVING while
    the manager refuses it). ``claimed()``: its waiting sequences whose admission the manager refused (their
    claims are renewed by each heartbeat)."""
    seen = [0, 0.0]  # steps and step seconds already reported

    def load() -> ComputeLoadReport:
        steps, seconds = loop.steps - seen[0], loop.step_seconds - seen[1]
        seen[:] = [loop.steps, loop.step_seconds]
        mean = seconds / steps if steps else 0.0
        held_now = None if held is None else tuple(held())
        waiting = None if claimed is None else tuple(claimed())
        return ComputeLoadReport(
            loop.num_running, loop.num_waiting, loop.num_tokens_held, steps, mean, seq_ids=held_now,
            waiting_seq_ids=waiting,
        )  # fmt: skip

    return ComputeRegistrar(
        config.manager_address,
        config.instance_id,
        f"{config.advertise_host or config.host}:{port}",
        load,
        config.home_server_ids,
        config.node_name,
        layout,
        on_refused,
    )
