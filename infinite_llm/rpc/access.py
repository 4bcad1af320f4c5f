"""Who may call what: per service, the roles (from the caller's certificate, ``rpc/tls.py``) admitted to
its RPCs. The one table of the mesh's authorization (DESIGN.md §6), read by
:class:`~infinite_llm.rpc.interceptors.roles.RoleInterceptor`.

Each service admits only the roles that need its RPCs: an attention server answers the manager (placement,
migration) and compute instances (attention steps); the manager answers attention servers (their
membership), compute instances (their membership, placement) and, for reads, the router and operators
(``client``); a compute instance answers the router and the manager; the router answers clients and the
gateway. Health and reflection are open to any peer the TLS handshake admitted: kubelet probes and
``grpcurl list`` need nothing else. A service missing from the table admits nobody.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


@dataclass(frozen=True)
class Access:
    """``roles`` admitted to every RPC of a service, unless ``methods`` names the roles of one RPC."""

    roles: frozenset[str]
    methods: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def admits(self, method: str, role: str | None) -> bool:
        return role is not None and role in self.methods.get(method, self.roles)


def _roles(*names: str) -> frozenset[str]:
    return frozenset(names)


ACCESS: Mapping[str, Access] = {
    "infinite_llm.v1.AttentionServer": Access(
        _roles("manager", "compute"),
        # prefix caching: only the manager attaches or caches rBlocks, in step with its index and ledger
        # (an import caches only what its source had cached: a shared rBlock moves as a cached one)
        {"AttachBlocks": _roles("manager"), "CacheBlocks": _roles("manager"), "BlockReaders": _roles("manager")},
    ),
    "infinite_llm.v1.GlobalManager": Access(
        _roles("compute"),  # Place, Release, the compute instances' own membership
        {
            "Register": _roles("attention"),
            "Heartbeat": _roles("attention"),
            "Deregister": _roles("attention"),
            "GetClusterState": _roles("attention", "compute", "router", "gateway", "client", "manager"),
            "ListComputeInstances": _roles("compute", "router", "client", "manager"),
        },
    ),
    "infinite_llm.v1.ComputeInstance": Access(_roles("router", "manager")),
    "infinite_llm.v1.Router": Access(_roles("client", "gateway")),
}


def split_method(full_method: str) -> tuple[str, str]:
    """``/infinite_llm.v1.Router/Abort`` -> ``("infinite_llm.v1.Router", "Abort")``."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def admits(full_method: str, role: str | None, table: Mapping[str, Access] = ACCESS) -> bool:
    """May a caller of ``role`` make the call ``full_method``?"""
    service, method = split_method(full_method)
    if service in OPEN_SERVICES:
        return True
    access = table.get(service)
    return access is not None and access.admits(method, role)
