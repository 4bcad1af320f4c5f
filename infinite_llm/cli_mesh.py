"""Mesh commands of ``infinite-llm``: ``serve <role>``, ``up`` (the local mesh) and ``status``.

Each ``serve`` command builds its frozen config from flags (validated, clear messages) and runs the
service until SIGTERM/SIGINT. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from infinite_llm.cli_tls import HealthPort, Insecure, TlsDir, load_cli_tls, setup_tls
from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import InvalidRequest, Unavailable
from infinite_llm.rpc.options import SHUTDOWN_GRACE_S

err = Console(stderr=True, soft_wrap=True)
serve_app = typer.Typer(no_args_is_help=True, help="Run one service of the mesh.")

Host = Annotated[str, typer.Option(help="Interface to listen on.")]
Model = Annotated[str | None, typer.Option(help="HF checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct).")]
BlockSize = Annotated[int, typer.Option(help="Tokens per rBlock (must match across the mesh).")]
Transport = Annotated[
    str,
    typer.Option(
        help="How attention tensors travel: grpc, or torch (torch.distributed: gloo on CPU, NCCL on GPU; "
        "gRPC keeps the control, and a pair whose process group cannot form falls back to gRPC)."
    ),
]
Device = Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")]
NodeName = Annotated[
    str,
    typer.Option(
        envvar="NODE_NAME",
        help="The node (machine) this process runs on; in Kubernetes spec.nodeName through the downward API. "
        "Attention servers and compute instances with the same node name are each other's homes ('' = none).",
    ),
]
PrefixCaching = Annotated[
    bool,
    typer.Option(
        "--prefix-caching/--no-prefix-caching",
        help="Share the KV of full rBlocks of identical prompt prefixes across the cluster (on by default).",
    ),
]


def split_ids(values: list[str] | None, param_hint: str) -> tuple[str, ...]:
    """Ids of a repeatable, comma-separated option (``--home a --home b,c``), checked; BadParameter otherwise."""
    from infinite_llm.core.errors import InvalidRequest
    from infinite_llm.core.ids import check_id

    ids = [v.strip() for value in values or () for v in value.split(",")]
    try:
        return tuple(dict.fromkeys(check_id(param_hint.lstrip("-"), i) for i in ids))
    except InvalidRequest as e:
        raise typer.BadParameter(e.message, param_hint=param_hint) from None


def _transport(text: str) -> str:
    if text not in ("grpc", "torch"):
        raise typer.BadParameter(f"unknown transport {text!r}; use grpc or torch", param_hint="--transport")
    return text


def device_option(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise typer.BadParameter(f"unknown device {text!r}; use cpu, cuda or cuda:N", param_hint="--device")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(f"--device {text}: this machine has no CUDA device", param_hint="--device")
    return text


MetricsPort = Annotated[int, typer.Option(help="Serve Prometheus /metrics on this HTTP port (0 = off).")]
ShutdownGrace = Annotated[
    float,
    typer.Option(
        help="Seconds the requests in flight get to finish after SIGTERM (new ones are refused and health says "
        "NOT_SERVING at once); match the pod's terminationGracePeriodSeconds.",
        min=0,
    ),
]


def _size(text: str) -> int:
    from infinite_llm.rpc.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-memory") from None


API_KEY_ENV = "INFINITE_LLM_API_KEY"  # the router's and the gateway's --api-key; up's services inherit it
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def dtype_name(text: str) -> str:
    """The canonical name (``float32`` / ``bfloat16``) of a ``--dtype`` value; BadParameter otherwise."""
    if text not in DTYPE_NAMES:
        raise typer.BadParameter(f"unknown dtype {text!r}; use float32 or bfloat16", param_hint="--dtype")
    return DTYPE_NAMES[text]


def torch_dtype(text: str):  # noqa: ANN201
    """The ``torch.dtype`` of a ``--dtype`` value."""
    import torch

    return getattr(torch, dtype_name(text))


@serve_app.command("attention")
def serve_attention(
    kv_memory: Annotated[str, typer.Option(help="KV memory of this server, e.g. 64MiB or 2GiB.")] = "256MiB",
    server_id: Annotated[str, typer.Option(help="Stable identity (registration key).")] = "attn-0",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port (0 = any free one).")] = 50060,
    manager: Annotated[str, typer.Option(help="Global manager HOST:PORT to register with ('' = none).")] = "",
    advertise_host: Annotated[str, typer.Option(help="Host others reach this server at (default --host).")] = "",
    model: Model = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    dtype: Annotated[str, typer.Option(help="KV dtype: float32 or bfloat16.")] = "float32",
    device: Device = "cpu",
    metrics_port: MetricsPort = 0,
    transport: Transport = "grpc",
    node_name: NodeName = "",
    shutdown_grace: ShutdownGrace = SHUTDOWN_GRACE_S,
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
        kv_memory_bytes=_size(kv_memory),
        dtype=dtype_name(dtype),
        block_size=block_size,
        host=host,
        port=port,
        device=device_option(device),
        manager_address=manager,
        transport=_transport(transport),
        advertise_host=advertise_host,
        metrics_port=metrics_port,
        node_name=split_ids([node_name], "--node-name")[0] if node_name else "",
        grace_s=shutdown_grace,
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
    port: Annotated[int, typer.Option(help="gRPC port.")] = 50050,
    manager_id: Annotated[str, typer.Option(help="Identity in the leader election.")] = "manager-0",
    member_ttl: Annotated[int, typer.Option(help="Seconds a server stays listed without heartbeats.")] = 10,
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
    asyncio.run(serve(config))


@serve_app.command("compute")
def serve_compute(
    manager: Annotated[str, typer.Option(help="Global manager HOST:PORT.")] = "127.0.0.1:50050",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port.")] = 50070,
    instance_id: Annotated[str, typer.Option(help="Identity: its registration with the manager, logs, stats.")] = (
        "compute-0"
    ),
    model: Model = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
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
            transport=_transport(transport),
            home_server_ids=homes,
            node_name=node,
            advertise_host=advertise_host,
            migration_tokens_per_step=migration_tokens_per_step,
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
        str, typer.Option(help="Global manager HOST:PORT: send requests to the compute instances it lists.")
    ] = "",
    compute: Annotated[
        list[str] | None,
        typer.Option(help="A static compute instance HOST:PORT, or dns:///SERVICE:PORT for every pod (repeatable)."),
    ] = None,
    discovery_interval: Annotated[
        float, typer.Option(help="Seconds between two reads of the manager's list of compute instances.")
    ] = 1.0,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Public gRPC port.")] = 50051,
    model: Model = None,
    metrics_port: MetricsPort = 0,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="INFINITE_LLM_API_KEY",
            help="Require metadata 'authorization: Bearer <key>' with one of these keys (repeatable; "
            "default: none). The gateway is exempt: it checks its own callers' keys.",
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
            api_keys=tuple(api_key or ()),
            shutdown_grace_s=shutdown_grace,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    setup_tls("router", tls_dir, insecure, health_port)
    asyncio.run(serve(config))


@serve_app.command("gateway")
def serve_gateway(
    router: Annotated[str, typer.Option(help="Router HOST:PORT.")] = "127.0.0.1:50051",
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="INFINITE_LLM_API_KEY", help="Require 'Authorization: Bearer <key>' on /v1 (default: none)."
        ),
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
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    setup_tls("gateway", tls_dir, insecure)
    asyncio.run(serve(config))


def up(
    attention_servers: Annotated[int, typer.Option(help="Attention servers to start.")] = 3,
    compute_instances: Annotated[int, typer.Option(help="Compute instances to start.")] = 1,
    kv_memory: Annotated[str, typer.Option(help="KV memory per attention server, e.g. 64MiB.")] = "64MiB",
    port: Annotated[int, typer.Option(help="Router port.")] = 50051,
    manager_port: Annotated[int, typer.Option(help="Manager port (0 = any free one).")] = 50050,
    model: Model = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    gateway_port: Annotated[int, typer.Option(help="OpenAI-compatible REST gateway port (0 = any free one).")] = 8000,
    transport: Transport = "grpc",
    tls_dir: Annotated[
        str | None,
        typer.Option(
            help="Use the certificates in this directory (every role's) instead of making a CA in the run directory.",
            rich_help_panel="Security",
        ),
    ] = None,
    insecure: Insecure = False,
    prefix_caching: PrefixCaching = True,
) -> None:
    """Start etcd, the manager, attention servers, compute instances, the router and the gateway on loopback.
    Every gRPC port uses mTLS with certificates of a CA made for this mesh (printed: --tls-dir for clients)."""
    from infinite_llm.mesh import LocalMesh, MeshConfig

    config = MeshConfig(
        attention_servers=attention_servers,
        compute_instances=compute_instances,
        kv_memory_bytes=_size(kv_memory),
        router_port=port,
        manager_port=manager_port,
        model=model,
        block_size=block_size,
        gateway_port=gateway_port,
        transport=_transport(transport),
        tls_dir=tls_dir,
        insecure=insecure,
        prefix_caching=prefix_caching,
    )
    _refuse_busy_ports(config)  # before anything starts (a busy port would fail only at the gateway, ~20 s in)
    if insecure:
        load_cli_tls("client", None, insecure=True)  # says loudly that the mesh is plaintext
    mesh = LocalMesh(config)
    try:
        with err.status("starting the mesh (etcd, manager, servers, compute, router, gateway)...", spinner="dots"):
            mesh.start()
    except BaseException:
        _say_where_logs_are(mesh)
        raise
    previous = {}  # the handlers before ours, put back when the mesh stops (`up` may run inside a process)
    try:
        _print_mesh(mesh, api_key_required=bool(os.environ.get(API_KEY_ENV)))
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # any: stop front to back
            previous[sig] = signal.signal(sig, lambda *_: done.set())
        reported: set[str] = set()
        while not done.wait(1.0):
            try:
                # As Kubernetes Deployments would: a crashed manager, compute instance, router or gateway is
                # started again; the mesh survives losing attention servers (their sequences are recomputed).
                for p in mesh.restart_crashed():
                    err.print(f"[yellow]{p.name} exited; restarted[/yellow] (log: {p.log_path})")
            except Unavailable as e:
                err.print(f"[red]a service keeps crashing[/red]: {e}")
                mesh.keep_logs = True
                break
            for p in [p for p in mesh.procs if not p.alive() and p.name not in reported]:
                reported.add(p.name)
                err.print(f"[yellow]{p.name} exited[/yellow] (log: {p.log_path})")
    finally:
        err.print("stopping the mesh...")
        mesh.stop()
        _say_where_logs_are(mesh)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _refuse_busy_ports(config) -> None:  # noqa: ANN001
    """Exit 2 naming the flag when a fixed port of ``up`` is taken (by another process or another flag)."""
    from infinite_llm.mesh import HOST, port_in_use

    flags = {"--port": config.router_port, "--manager-port": config.manager_port, "--gateway-port": config.gateway_port}
    seen: dict[int, str] = {}
    for flag, port in flags.items():
        if port == 0:  # any free one
            continue
        if port in seen:
            raise typer.BadParameter(f"port {port} is also given to {seen[port]}; give each its own", param_hint=flag)
        seen[port] = flag
        if port_in_use(port):
            raise typer.BadParameter(
                f"port {port} is in use on {HOST} (another process listens there, perhaps an earlier mesh): "
                f"stop it or choose another port with {flag}",
                param_hint=flag,
            )


def _say_where_logs_are(mesh) -> None:  # noqa: ANN001
    """A mesh that failed keeps its logs (without certificates, keys or etcd's data): say where."""
    if mesh.keep_logs and mesh.log_dir.exists():
        err.print(f"the services' logs are kept in {mesh.log_dir} (its certificates, keys and etcd data removed)")


def _print_mesh(mesh, api_key_required: bool) -> None:  # noqa: ANN001
    """The services, their addresses, metrics and logs; the endpoints; and how clients get in: the API key
    (inherited by the router and the gateway from ``INFINITE_LLM_API_KEY``; never printed) and mTLS."""
    table = Table(title="local mesh")
    table.add_column("service")
    table.add_column("listens on")
    table.add_column("metrics")
    table.add_column("log")
    if mesh.etcd is not None:
        table.add_row("etcd", mesh.etcd.endpoint, "", str(mesh.etcd.log_path))
    for p in mesh.procs:
        metrics = f"http://{p.metrics_address}/metrics" if p.metrics_address else ""
        table.add_row(p.name, p.address, metrics, str(p.log_path))
    out = _stdout()
    out.print(table)
    out.print(
        f"router: {mesh.router_address}    manager: {mesh.manager_address}    "
        f"OpenAI API: http://{mesh.gateway_address}/v1    (Ctrl-C stops all)"
    )
    if api_key_required:
        out.print(
            f"API key required ({API_KEY_ENV} is set): the OpenAI API and the router take "
            f"'Authorization: Bearer <key>' (generate --router sends it from --api-key or {API_KEY_ENV})"
        )
    if mesh.tls_dir is not None:
        out.print(f"mTLS on; clients: --tls-dir {mesh.tls_dir}   (or export INFINITE_LLM_TLS_DIR={mesh.tls_dir})")
        if mesh.etcd_tls_dir is not None:
            d = mesh.etcd_tls_dir
            out.print(
                f"etcd admits only the manager's etcd certificate: etcdctl --endpoints {mesh.etcd.endpoint} "
                f"--cacert {d}/ca.pem --cert {d}/manager.pem --key {d}/manager-key.pem"
            )
    else:
        out.print("[red]mTLS OFF (--insecure): every port is plaintext and unauthenticated[/red]")


def status(
    manager: Annotated[str, typer.Option(help="Global manager HOST:PORT.")] = "127.0.0.1:50050",
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
) -> None:
    """Print the cluster: servers with rBlocks used/free, and where each sequence's rBlocks are."""
    from infinite_llm.services.admin import cluster_state, render_status

    tls = load_cli_tls("client", tls_dir, insecure)
    render_status(cluster_state(manager, tls=tls), _stdout())


def _stdout() -> Console:
    """stdout for tables and address lines. Rich cuts them to 80 columns when stdout is not a terminal (a log
    file, a pipe), which hid the log paths and metrics addresses of ``up``; there rows stay whole, unless
    ``COLUMNS`` says otherwise."""
    console = Console(soft_wrap=True)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(soft_wrap=True, width=400)


def _bench():  # noqa: ANN202
    """``infinite-llm bench``: its flags live with the load generator (``infinite_llm.bench.command``)."""
    from infinite_llm.bench.command import bench

    return bench


def register(app: typer.Typer) -> None:
    app.add_typer(serve_app, name="serve")
    app.command("up")(up)
    app.command("status")(status)
    app.command("bench")(_bench())
    from infinite_llm.cli_tls import tls_app

    app.add_typer(tls_app, name="tls")
