"""TLS flags of every ``infinite-llm`` command that serves or dials, and ``infinite-llm tls init``.

mTLS is on by default: a command needs ``--tls-dir`` (env ``INFINITE_LLM_TLS_DIR``: ``ca.pem``,
``<role>.pem``, ``<role>-key.pem``) or an explicit ``--insecure``, which it logs loudly. The identity
loaded here is the process's (``rpc/tls.set_process_tls``): every server and channel of the process uses it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from infinite_llm.cli_options import PORT_RANGE

if TYPE_CHECKING:  # every `infinite-llm` call loads this module: gRPC only when a command runs
    from infinite_llm.rpc.certs import TlsDirExists
    from infinite_llm.rpc.tls import TlsConfig

TLS_DIR_ENV = "INFINITE_LLM_TLS_DIR"  # = infinite_llm.rpc.tls.TLS_DIR_ENV

log = logging.getLogger("infinite_llm")
err = Console(stderr=True, soft_wrap=True)

TlsDir = Annotated[
    str | None,
    typer.Option(
        envvar=TLS_DIR_ENV,
        help="mTLS: directory with ca.pem, <role>.pem and <role>-key.pem (infinite-llm tls init makes one; "
        "infinite-llm up prints its own).",
        rich_help_panel="Security",
    ),
]
HealthPort = Annotated[
    int,
    typer.Option(
        envvar="INFINITE_LLM_HEALTH_PORT",
        help="With mTLS: also answer grpc.health.v1 (only) in plaintext on this port, for Kubernetes' gRPC "
        "probes, which cannot present a certificate (0 = off).",
        rich_help_panel="Security",
        **PORT_RANGE,
    ),
]
Insecure = Annotated[
    bool,
    typer.Option(
        envvar="INFINITE_LLM_INSECURE",
        help="Plaintext gRPC without certificates or roles (local experiments only).",
        rich_help_panel="Security",
    ),
]


def setup_tls(role: str, tls_dir: str | None, insecure: bool, health_port: int = 0) -> TlsConfig | None:
    """For a service: load its identity (:func:`load_cli_tls`) and make it the process's, which every
    server and channel of the process then uses. ``health_port``: see :data:`HealthPort`."""
    from infinite_llm.rpc.tls import set_process_tls

    tls = load_cli_tls(role, tls_dir, insecure)
    if not 0 <= health_port < 65536:
        raise typer.BadParameter(f"must be in [0, 65535], got {health_port}", param_hint="--health-port")
    set_process_tls(tls, health_port=health_port)
    return tls


def load_cli_tls(role: str, tls_dir: str | None, insecure: bool) -> TlsConfig | None:
    """``role``'s identity from ``tls_dir``; with ``insecure``, none (plaintext), said loudly. Tools that only
    dial (status, generate --router, bench) pass it to their channels. Raises BadParameter when neither is
    given or a file is missing."""
    from infinite_llm.core.errors import InvalidRequest
    from infinite_llm.rpc.tls import load_tls_dir

    if insecure:
        log.warning(
            "--insecure: mTLS is OFF; every gRPC port of this %s is plaintext and unauthenticated. "
            "Anyone who can reach it can call it. Use only for local experiments.",
            role,
        )
        return None
    if not tls_dir:
        raise typer.BadParameter(
            f"mTLS is on by default: give --tls-dir DIR (or {TLS_DIR_ENV}) holding ca.pem, {role}.pem and "
            f"{role}-key.pem, or --insecure for plaintext",
            param_hint="--tls-dir",
        )
    try:
        tls = load_tls_dir(tls_dir, role)
    except InvalidRequest as e:
        raise typer.BadParameter(e.message, param_hint="--tls-dir") from None
    log.debug("mTLS as %s with certificates from %s", role, tls_dir)
    return tls


tls_app = typer.Typer(no_args_is_help=True, help="Certificates for mTLS between the services of a mesh.")
Force = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace the CA and keys already in the directory (every service using them must then get the "
        "new files: its connections to the others fail until then).",
    ),
]


def _refuse_existing(e: TlsDirExists) -> typer.Exit:
    """Exit 2 naming the files a new CA would have replaced: servers reload changed files, so writing over
    a live cluster's directory breaks every connection."""
    err.print(
        f"[red]error:[/red] {e.directory} already holds a CA or keys ({', '.join(e.files)}); not replacing "
        "them (servers using them would reject each other): give --force to write a new CA anyway"
    )
    return typer.Exit(2)


@tls_app.command("init")
def tls_init(
    directory: Annotated[Path, typer.Argument(help="Where to write ca.pem, ca-key.pem, <role>.pem, <role>-key.pem.")],
    host: Annotated[
        list[str] | None,
        typer.Option(help="Another DNS name or IP of the services (e.g. manager.infinite-llm.svc); repeatable."),
    ] = None,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 365,
    force: Force = False,
) -> None:
    """Create a cluster CA and one certificate per role (manager, attention, compute, router, gateway, client).
    Refuses (exit 2) a directory that already holds a CA or keys, unless --force."""
    from infinite_llm.rpc.certs import TlsDirExists, write_tls_dir

    if days < 1:
        raise typer.BadParameter(f"days must be >= 1, got {days}", param_hint="--days")
    try:
        out = write_tls_dir(directory, hosts=tuple(host or ()), days=days, force=force)
    except TlsDirExists as e:
        raise _refuse_existing(e) from None
    err.print(f"wrote a cluster CA and per-role certificates to {out}; clients use --tls-dir {out}")


@tls_app.command("etcd-init")
def tls_etcd_init(
    directory: Annotated[Path, typer.Argument(help="Where to write ca.pem, etcd.pem, manager.pem and their keys.")],
    host: Annotated[
        list[str] | None,
        typer.Option(help="A DNS name or IP the manager and etcd's peers dial etcd by (etcd.example); repeatable."),
    ] = None,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 365,
    force: Force = False,
) -> None:
    """Create an etcd CA (separate from the cluster's), etcd's certificate and the manager's etcd client
    certificate: etcd trusts only this CA, so it admits the manager and no other role. Refuses (exit 2) a
    directory that already holds them, unless --force."""
    from infinite_llm.rpc.certs import TlsDirExists, write_etcd_tls_dir

    if days < 1:
        raise typer.BadParameter(f"days must be >= 1, got {days}", param_hint="--days")
    try:
        out = write_etcd_tls_dir(directory, hosts=tuple(host or ()), days=days, force=force)
    except TlsDirExists as e:
        raise _refuse_existing(e) from None
    err.print(
        f"wrote an etcd CA, etcd's and the manager's etcd certificates to {out}: run etcd with "
        f"--trusted-ca-file {out}/ca.pem --cert-file {out}/etcd.pem --key-file {out}/etcd-key.pem "
        f"--client-cert-auth, and serve manager --etcd https://HOST:2379 --etcd-tls-dir {out}"
    )


@tls_app.command("k8s-secrets")
def tls_k8s_secrets(
    namespace: Annotated[str, typer.Option(envvar="POD_NAMESPACE", help="Namespace ('' = this pod's).")] = "",
    prefix: Annotated[str, typer.Option(help="Secret names: <prefix>-<role>.")] = "infinite-llm-tls",
) -> None:
    """In a pod (the dev overlay's tls-bootstrap Job): create one kubernetes.io/tls Secret per role from a new
    CA, unless all exist, and etcd's two (etcd's, the manager's etcd client) from an etcd CA likewise.
    Production uses cert-manager instead."""
    from kubernetes import client, config

    from infinite_llm.rpc.k8s_secrets import ensure_role_secrets

    config.load_incluster_config()
    if not namespace:
        namespace = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
    wrote = ensure_role_secrets(client.CoreV1Api(), namespace, prefix)
    err.print(f"role Secrets in {namespace}: {'written' if wrote else 'already there'}")
