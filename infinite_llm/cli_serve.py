"""``infinite-llm serve <role>``: one service of the mesh (attention, manager, compute, router, gateway).

Each command builds its frozen config from flags (validated, clear messages) and runs the service until
SIGTERM/SIGINT. Logs go to stderr. The service's modules (and torch, where it needs it) are imported only
when its command runs.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Annotated

import typer

from infinite_llm.cli_options import (
    API_KEY_ENV,
    PORT_RANGE,
    BlockSize,
    Device,
    Host,
    ManagerTarget,
    MetricsPort,
    Model,
    NodeName,
    PrefixCaching,
    ShutdownGrace,
    Transport,
    device_option,
    dtype_name,
    kv_memory_option,
    size_option,
    split_ids,
    target_option,
    torch_dtype,
    transport_option,
)
from infinite_llm.cli_tls import HealthPort, Insecure, TlsDir, setup_tls
from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.rpc.options import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S

serve_app = typer.Typer(no_args_is_help=True, help="Run one service of the mesh.")


@serve_app.command("attention")
def serve_attention(
    kv_memory: Annotated[str, typer.Option(help="KV memory of this server, e.g. 64MiB or 2GiB.")] = "256MiB",
    server_id: Annotated[str, typer.Option(help="Stable identity (registration key).")] = "attn-0",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port (0 = any free one).", **PORT_RANGE)] = 50060,
    manager: Annotated[
        str,
        typer.Option(
            help="Global manager HOST:PORT to register with ('' = none), or a gRPC target naming every manager "
            "(dns:///NAME:PORT, ipv4:IP1:PORT,IP2:PORT): calls go to the leader.",
            callback=target_option,
        ),
    ] = "",
    advertise_host: Annotated[str, typer.Option(help="Host others reach this server at (default --host).")] = "",
    model: Model = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    dtype: Annotated[str, typer.Option(help="KV dtype: float32, bfloat16 or float16.")] = "float32",
    device: Device = "cpu",
    metrics_port: MetricsPort = 0,
    transport: Transport = "grpc",
    node_name: NodeName = "",
    shutdown_grace: ShutdownGrace = SHUTDOWN_GRACE_S,
    drain_timeout: Annotated[
        float,
        typer.Option(
            help="After SIGTERM, seconds to wait for the manager to migrate this server's rBlocks to others "
            "before --shutdown-grace begins (0 = stop at once; a second signal cuts it short). The pod's "
            "terminationGracePeriodSeconds must cover both.",
            min=0,
        ),
    ] = DRAIN_TIMEOUT_S,
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
    health_port: HealthPort = 0,
) -> None:
    """Attention server: holds rBlocks in --kv-memory and computes partial attention over them."""
    from infinite_llm.models.registry import load_model_config, resolve_model
    from infinite_llm.services.attention.server import AttentionServerConfig, main

    config = AttentionServerConfig.for_model(
        load_model_config(resolve_model(model)),
        server_id=server_id,
        kv_memory_bytes=kv_memory_option(kv_memory),
        dtype=dtype_name(dtype),
        block_size=block_size,
        host=host,
        port=port,
        device=device_option(device),
        manager_address=manager,
        transport=transport_option(transport),
        advertise_host=advertise_host,
        metrics_port=metrics_port,
        node_name=split_ids([node_name], "--node-name")[0] if node_name else "",
        grace_s=shutdown_grace,
        drain_timeout_s=drain_timeout,
    )
    setup_tls("attention", tls_dir, insecure, health_port)
    sys.exit(main(config))


@serve_app.command("manager")
def serve_manager(
    etcd: Annotated[
        str,
        typer.Option(
            help="etcd client endpoint HOST:PORT, or https://HOST:PORT to dial it over mTLS with --etcd-tls-dir's "
            "certificate (else --tls-dir's)."
        ),
    ] = "127.0.0.1:2379",
    etcd_tls_dir: Annotated[
        str | None,
        typer.Option(
            envvar="INFINITE_LLM_ETCD_TLS_DIR",
            help="etcd's mTLS: directory with ca.pem (etcd's CA), manager.pem and manager-key.pem "
            "(infinite-llm tls etcd-init makes one).",
            rich_help_panel="Security",
        ),
    ] = None,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port.", **PORT_RANGE)] = 50050,
    manager_id: Annotated[str, typer.Option(help="Identity in the leader election.")] = "manager-0",
    standby: Annotated[
        bool,
        typer.Option(
            "--standby",
            help="Hot standby: serve at once (health: alive; GlobalManager NOT_SERVING, calls refused naming the "
            "leader) and take the lead whenever the leader goes, however long that takes. Without it the manager "
            "must lead within 60 s or exit. Clients reach whichever leads (client-side health checking).",
        ),
    ] = False,
    member_ttl: Annotated[
        int,
        typer.Option(
            help="Seconds an attention server or compute instance stays listed without heartbeats while a manager "
            "leads. Its etcd lease lasts 15 s longer, so a failover between managers keeps every member listed."
        ),
    ] = 10,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    k8s_statefulset: Annotated[
        str,
        typer.Option(
            help="Scale this attention-server StatefulSet with the KV pressure ('' = no autoscaling; in a pod).",
            rich_help_panel="Elastic attention pool",
        ),
    ] = "",
    k8s_namespace: Annotated[
        str, typer.Option(help="Its namespace ('' = this pod's).", rich_help_panel="Elastic attention pool")
    ] = "",
    min_replicas: Annotated[
        int, typer.Option(help="Fewest attention servers.", rich_help_panel="Elastic attention pool")
    ] = 1,
    max_replicas: Annotated[
        int, typer.Option(help="Most attention servers.", rich_help_panel="Elastic attention pool")
    ] = 8,
    scale_up_below: Annotated[
        float,
        typer.Option(
            help="Add a server when the free fraction of rBlocks stays below this.",
            rich_help_panel="Elastic attention pool",
        ),
    ] = 0.10,
    scale_down_above: Annotated[
        float,
        typer.Option(help="Drain and remove one when it stays above this.", rich_help_panel="Elastic attention pool"),
    ] = 0.60,
    scale_up_after: Annotated[
        float,
        typer.Option(help="Seconds the pressure must last before adding.", rich_help_panel="Elastic attention pool"),
    ] = 30.0,
    scale_down_after: Annotated[
        float,
        typer.Option(help="Seconds the surplus must last before draining.", rich_help_panel="Elastic attention pool"),
    ] = 300.0,
    scale_cooldown: Annotated[
        float,
        typer.Option(help="Seconds after a change before the next one.", rich_help_panel="Elastic attention pool"),
    ] = 120.0,
    autoscale_interval: Annotated[
        float, typer.Option(help="Seconds between two looks at the pool.", rich_help_panel="Elastic attention pool")
    ] = 5.0,
    metrics_port: MetricsPort = 0,
    shutdown_grace: ShutdownGrace = SHUTDOWN_GRACE_S,
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
    health_port: HealthPort = 0,
) -> None:
    """Global manager: membership, capacity view and rBlock placement ledger in etcd."""
    from infinite_llm.services.manager.autoscale import AutoscaleSettings, ScalingConfig
    from infinite_llm.services.manager.server import ManagerServerConfig, serve

    try:
        autoscale = None
        if k8s_statefulset:
            policy = ScalingConfig(
                min_replicas,
                max_replicas,
                scale_up_below,
                scale_down_above,
                scale_up_after,
                scale_down_after,
                scale_cooldown,
            )
            autoscale = AutoscaleSettings(k8s_statefulset, k8s_namespace, policy, autoscale_interval)
        config = ManagerServerConfig(
            etcd=etcd,
            etcd_tls_dir=etcd_tls_dir,
            host=host,
            port=port,
            manager_id=manager_id,
            standby=standby,
            block_size=block_size,
            member_ttl_s=member_ttl,
            autoscale=autoscale,
            metrics_port=metrics_port,
            shutdown_grace_s=shutdown_grace,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    setup_tls("manager", tls_dir, insecure, health_port)
    try:
        config.etcd_identity()  # a missing or unreadable --etcd-tls-dir is a usage error, before anything starts
    except InvalidRequest as e:
        raise typer.BadParameter(e.message, param_hint="--etcd-tls-dir") from None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--etcd") from None
    sys.exit(asyncio.run(serve(config)))  # 1: leadership lost (a fresh process campaigns)


@serve_app.command("compute")
def serve_compute(
    manager: ManagerTarget = "127.0.0.1:50050",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port.", **PORT_RANGE)] = 50070,
    instance_id: Annotated[str, typer.Option(help="Identity: its registration with the manager, logs, stats.")] = (
        "compute-0"
    ),
    model: Model = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one step.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of one step (chunked prefill).")] = 512,
    metrics_port: MetricsPort = 0,
    device: Device = "cpu",
    transport: Transport = "grpc",
    max_waiting: Annotated[
        int,
        typer.Option(help="Requests queued behind the running batch before new ones are refused (RESOURCE_EXHAUSTED)."),
    ] = 1024,
    home: Annotated[
        list[str] | None,
        typer.Option(help="A home attention server (one on this node) by server id; repeatable or comma-separated."),
    ] = None,
    node_name: NodeName = "",
    advertise_host: Annotated[
        str, typer.Option(help="Host the router reaches this instance at (default --host; Kubernetes: the pod IP).")
    ] = "",
    migration_tokens_per_step: Annotated[
        int,
        typer.Option(
            help="KV tokens a live migration moves between two decode steps (0: run no migrations).",
            envvar="INFINITE_LLM_MIGRATION_TOKENS_PER_STEP",
        ),
    ] = 16,
    drain_tokens_per_step: Annotated[
        int,
        typer.Option(
            help="KV tokens a migration off a draining attention server (stopping, or scaled down) moves between "
            "two decode steps: a drain must finish before the server's --drain-timeout.",
            envvar="INFINITE_LLM_DRAIN_TOKENS_PER_STEP",
            min=1,
        ),
    ] = 256,
    prefix_caching: PrefixCaching = True,
    placement_lookahead_blocks: Annotated[
        int,
        typer.Option(
            help="rBlocks a running sequence asks the manager for beyond its need in one Place (0: exact).",
            envvar="INFINITE_LLM_PLACEMENT_LOOKAHEAD_BLOCKS",
        ),
    ] = 2,
    shutdown_grace: ShutdownGrace = SHUTDOWN_GRACE_S,
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
    health_port: HealthPort = 0,
) -> None:
    """Compute instance: dense layers + scheduler; attention on the attention servers. Registers with the
    manager (routers discover it there) with its homes: --home servers and those registered with --node-name."""
    from infinite_llm.services.compute.server import ComputeConfig, serve

    homes = split_ids(home, "--home")
    node = split_ids([node_name], "--node-name")[0] if node_name else ""
    try:
        config = ComputeConfig(
            manager_address=manager,
            host=host,
            port=port,
            instance_id=instance_id,
            model=model,
            dtype=torch_dtype(dtype),
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            metrics_port=metrics_port,
            device=device_option(device),
            max_waiting=max_waiting,
            transport=transport_option(transport),
            home_server_ids=homes,
            node_name=node,
            advertise_host=advertise_host,
            migration_tokens_per_step=migration_tokens_per_step,
            drain_tokens_per_step=drain_tokens_per_step,
            enable_prefix_caching=prefix_caching,
            placement_lookahead_blocks=placement_lookahead_blocks,
            shutdown_grace_s=shutdown_grace,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    setup_tls("compute", tls_dir, insecure, health_port)
    asyncio.run(serve(config))


@serve_app.command("router")
def serve_router(
    manager: Annotated[
        str,
        typer.Option(
            help="Global manager HOST:PORT (or a target naming every manager, as for serve compute): send requests "
            "to the compute instances it lists.",
            callback=target_option,
        ),
    ] = "",
    compute: Annotated[
        list[str] | None,
        typer.Option(
            help="A static compute instance HOST:PORT, or dns:///SERVICE:PORT for every pod (repeatable).",
            callback=target_option,
        ),
    ] = None,
    discovery_interval: Annotated[
        float, typer.Option(help="Seconds between two reads of the manager's list of compute instances.")
    ] = 1.0,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Public gRPC port.", **PORT_RANGE)] = 50051,
    model: Model = None,
    metrics_port: MetricsPort = 0,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="Require metadata 'authorization: Bearer <key>' with one of these keys (repeatable; "
            "default: INFINITE_LLM_API_KEY, one key, if set; else none). The gateway is exempt: it checks its "
            "own callers' keys.",
            rich_help_panel="Security",
        ),
    ] = None,
    shutdown_grace: ShutdownGrace = SHUTDOWN_GRACE_S,
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
    health_port: HealthPort = 0,
) -> None:
    """Router: the public gRPC API (Generate, GenerateStream, Abort, ListModels, Tokenize). Needs --manager
    (compute instances discovered, followed as they come and go) or --compute, or both."""
    from infinite_llm.services.router.server import RouterConfig, serve

    try:
        config = RouterConfig(
            compute_addresses=tuple(compute or ()),
            host=host,
            port=port,
            model=model,
            metrics_port=metrics_port,
            manager_address=manager,
            discovery_interval_s=discovery_interval,
            api_keys=tuple(api_key or ()) or _env_api_keys(),
            shutdown_grace_s=shutdown_grace,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    setup_tls("router", tls_dir, insecure, health_port)
    asyncio.run(serve(config))


@serve_app.command("gateway")
def serve_gateway(
    router: Annotated[str, typer.Option(help="Router HOST:PORT.", callback=target_option)] = "127.0.0.1:50051",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.", **PORT_RANGE)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar=API_KEY_ENV, help="Require 'Authorization: Bearer <key>' on /v1 (default: none)."),
    ] = None,
    model: Model = None,
    special_tokens_in_messages: Annotated[
        bool,
        typer.Option(
            help="Parse special-token text (e.g. <|im_end|>) in chat message content as control tokens. "
            "Only for trusted callers: it lets a message end its turn and forge another role's. "
            "Default: content is plain text."
        ),
    ] = False,
    ssl_certfile: Annotated[
        str | None,
        typer.Option(help="Serve HTTPS with this certificate (PEM; default: HTTP).", rich_help_panel="Security"),
    ] = None,
    ssl_keyfile: Annotated[
        str | None, typer.Option(help="The key of --ssl-certfile (PEM).", rich_help_panel="Security")
    ] = None,
    shutdown_grace: ShutdownGrace = SHUTDOWN_GRACE_S,
    max_choices_per_request: Annotated[
        int,
        typer.Option(
            help="The most choices (prompts x n) one request may ask for, each a request in the mesh; more is a 400.",
        ),
    ] = 128,
    max_request_bytes: Annotated[
        str,
        typer.Option(
            help="The largest request body taken, e.g. 16MiB; a larger one is a 413 before it is parsed (0: no limit).",
            rich_help_panel="Security",
        ),
    ] = "16MiB",
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
) -> None:
    """OpenAI-compatible REST gateway: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    from infinite_llm.services.gateway.server import GatewayConfig, serve

    try:
        config = GatewayConfig(
            router=router,
            host=host,
            port=port,
            api_key=api_key,
            model=model,
            special_tokens_in_messages=special_tokens_in_messages,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            shutdown_grace_s=shutdown_grace,
            max_choices_per_request=max_choices_per_request,
            max_request_bytes=size_option(max_request_bytes, "--max-request-bytes"),
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    setup_tls("gateway", tls_dir, insecure)
    asyncio.run(serve(config))


def _env_api_keys() -> tuple[str, ...]:
    """``INFINITE_LLM_API_KEY`` as one key (click would split a repeatable option's variable at whitespace)."""
    key = os.environ.get(API_KEY_ENV, "")
    return (key,) if key else ()
