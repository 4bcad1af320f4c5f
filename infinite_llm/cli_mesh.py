"""Mesh commands of ``infinite-llm``: ``serve <role>`` (:mod:`.cli_serve`), ``up`` (the local mesh,
:mod:`.cli_up`), ``status`` and ``bench``, registered on the app by :func:`register`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from infinite_llm.cli_options import ManagerTarget, stdout_console
from infinite_llm.cli_serve import serve_app
from infinite_llm.cli_tls import Insecure, TlsDir, load_cli_tls
from infinite_llm.cli_up import up

STATUS_ROLES = ("client", "manager", "router", "gateway", "compute", "attention")  # may read the cluster state


def status(
    manager: ManagerTarget = "127.0.0.1:50050",
    tls_dir: TlsDir = None,
    tls_role: Annotated[
        str,
        typer.Option(
            help="Whose certificate in --tls-dir to present: client, or a service's (inside a service's pod, "
            "whose --tls-dir holds only its own: e.g. manager).",
            rich_help_panel="Security",
        ),
    ] = "client",
    insecure: Insecure = False,
) -> None:
    """Print the cluster: servers with rBlocks used/free, and where each sequence's rBlocks are."""
    import grpc

    from infinite_llm.core.errors import InfiniteLLMError
    from infinite_llm.rpc.options import MANAGER_KEEPALIVE_MS
    from infinite_llm.services.admin import STATE_TIMEOUT_S, cluster_state, render_status

    if tls_role not in STATUS_ROLES:
        raise typer.BadParameter(f"must be one of {', '.join(STATUS_ROLES)}, got {tls_role!r}", param_hint="--tls-role")
    tls = load_cli_tls(tls_role, tls_dir, insecure)
    try:
        state = cluster_state(manager, tls=tls)
    except InfiniteLLMError as e:
        if getattr(e, "grpc_status", None) == grpc.StatusCode.UNIMPLEMENTED:  # another service listens there
            raise InfiniteLLMError(
                f"{manager} does not answer the global manager's ClusterState ({e.message}): is it another "
                "service's address? give the manager's with --manager"
            ) from None
        if "backend unhealthy" in e.message:  # client-side health checking: nobody reports the service SERVING
            raise InfiniteLLMError(
                f"no manager at {manager} leads ({e.message}): a standby refuses these calls, and after a leader "
                "dies its standby leads within the leader's session lease (10 s); give a target naming every "
                "manager (dns:///NAME:PORT, ipv4:IP1:PORT,IP2:PORT)"
            ) from None
        if getattr(e, "grpc_status", None) == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise InfiniteLLMError(
                f"no answer from {manager} within {STATE_TIMEOUT_S:g} s ({e.message}): a manager that takes the "
                "call but does not answer is frozen (a stopped process, a paused VM) or overloaded; clients stop "
                f"sending it calls within ~{sum(MANAGER_KEEPALIVE_MS) / 1000:g} s and a standby leads within the "
                "leader's session lease (10 s): try again"
            ) from None
        if "errors resolving" in e.message and "," in manager and ":///" not in manager:
            raise InfiniteLLMError(
                f"{manager!r} is not one target: list several managers as ipv4:{manager} ({e.message})"
            ) from None
        raise
    render_status(state, stdout_console())


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
