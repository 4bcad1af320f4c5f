"""``infinite-llm up``: the whole mesh on loopback (etcd, manager, attention servers, compute instances,
router, gateway) as child processes of one command, restarted when they crash and stopped front to back on
Ctrl-C; the banner of where each listens and how clients get in. The processes: ``infinite_llm.mesh``.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Annotated

import typer
from rich.table import Table

from infinite_llm.cli_options import (
    API_KEY_ENV,
    PORT_RANGE,
    BlockSize,
    Model,
    PrefixCaching,
    Transport,
    device_option,
    dtype_name,
    err,
    kv_memory_option,
    stdout_console,
    transport_option,
)
from infinite_llm.cli_tls import Insecure, load_cli_tls
from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import Unavailable


def up(
    ctx: typer.Context,
    attention_servers: Annotated[int, typer.Option(help="Attention servers to start.")] = 3,
    compute_instances: Annotated[int, typer.Option(help="Compute instances to start.")] = 1,
    kv_memory: Annotated[str, typer.Option(help="KV memory per attention server, e.g. 64MiB.")] = "64MiB",
    port: Annotated[int, typer.Option(help="Router port.", **PORT_RANGE)] = 50051,
    manager_port: Annotated[int, typer.Option(help="Manager port (0 = any free one).", **PORT_RANGE)] = 50050,
    standby_managers: Annotated[
        int,
        typer.Option(
            help="Hot-standby managers beside the leader (serve manager --standby, on free ports): kill the "
            "leader and one of them leads; every client follows.",
        ),
    ] = 0,
    model: Model = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    gateway_port: Annotated[
        int, typer.Option(help="OpenAI-compatible REST gateway port (0 = any free one).", **PORT_RANGE)
    ] = 8000,
    transport: Transport = "grpc",
    dtype: Annotated[
        str,
        typer.Option(
            help="float32, bfloat16 or float16: the compute instances' weights and activations and the attention "
            "servers' KV (one dtype for the whole mesh)."
        ),
    ] = "float32",
    device: Annotated[
        str, typer.Option(help="cpu, cuda or cuda:N: where the compute instances and attention servers compute.")
    ] = "cpu",
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
        kv_memory_bytes=kv_memory_option(kv_memory),
        router_port=port,
        manager_port=manager_port,
        standby_managers=standby_managers,
        model=model,
        block_size=block_size,
        gateway_port=gateway_port,
        transport=transport_option(transport),
        dtype=dtype_name(dtype),
        device=device_option(device),
        tls_dir=tls_dir,
        insecure=insecure,
        prefix_caching=prefix_caching,
        **_config_file(ctx),
    )
    _refuse_busy_ports(config)  # before anything starts (a busy port would fail only at the gateway, ~20 s in)
    _refuse_kv_memory_without_an_rblock(config)  # likewise: the first attention server would, after etcd and manager
    _refuse_a_bad_api_key()  # likewise: the router and the gateway would refuse it only once the rest is up
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
                    mesh.keep_logs = True  # what explains the crash outlives the mesh
            except Unavailable as e:
                err.print(f"[red]a service keeps crashing[/red]: {e}")
                mesh.keep_logs = True
                break
            for p in [p for p in mesh.procs if not p.alive() and p.name not in reported]:
                reported.add(p.name)
                err.print(f"[yellow]{p.name} exited[/yellow] (log: {p.log_path})")
                mesh.keep_logs = True
    finally:
        err.print("stopping the mesh...")
        mesh.stop()
        _say_where_logs_are(mesh)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _config_file(ctx: typer.Context) -> dict:
    """The root ``--config`` file (absolute: the services start elsewhere) and the options of its ``serve:``
    sections by role, for :class:`~infinite_llm.mesh.MeshConfig`; nothing without a file."""
    root = ctx.find_root()
    path = root.params.get("config")
    if not path:
        return {}
    serve = (root.default_map or {}).get("serve", {})
    return {"config_file": os.path.abspath(path), "file_options": {role: tuple(o) for role, o in serve.items()}}


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


ATTENTION_ENV = "INFINITE_LLM_SERVE_ATTENTION_"  # the environment's options of serve attention


def _refuse_kv_memory_without_an_rblock(config) -> None:  # noqa: ANN001
    """Exit 2 naming ``--kv-memory`` when an attention server's KV memory cannot hold one rBlock of the model
    (the check each attention server makes at startup). Skipped where the attention servers may load another
    model than ``--model`` says (a config file or the environment names theirs), and for a model that cannot be
    found, fetched or read: the services say why in their logs."""
    from infinite_llm.core.rmanager import KVLayout
    from infinite_llm.models.registry import load_model_config, resolve_model
    from infinite_llm.rpc import codec
    from infinite_llm.services.attention.server import check_kv_memory

    if config.model is None and (config.config_file or any(k.startswith(ATTENTION_ENV) for k in os.environ)):
        return
    try:
        model = load_model_config(resolve_model(config.model))
    except Exception:  # noqa: BLE001 - any failure is the services' to report
        return
    if model.head_dim is None:
        return
    dtype = codec.DTYPES[config.dtype or "float32"]  # serve attention's default KV dtype
    layout = KVLayout(model.num_hidden_layers, config.block_size, model.num_key_value_heads, model.head_dim, dtype)
    try:
        check_kv_memory(config.kv_memory_bytes, layout)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-memory") from None


def _refuse_a_bad_api_key() -> None:
    """Exit 2 when ``INFINITE_LLM_API_KEY`` is set to a key the router and the gateway would refuse."""
    from infinite_llm.rpc.interceptors.api_key import check_api_key

    key = os.environ.get(API_KEY_ENV)
    if key:
        try:
            check_api_key(key, API_KEY_ENV)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None  # the message names the variable


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
    out = stdout_console()
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
