"""The dev cluster's certificates: one Kubernetes Secret per role, made once by the ``tls-bootstrap`` Job
(``infinite-llm tls k8s-secrets``) of the dev overlay. Production gets the same Secrets from cert-manager.

Each Secret ``<prefix>-<role>`` is ``kubernetes.io/tls`` with cert-manager's keys (``ca.crt``, ``tls.crt``,
``tls.key``), so pods mount either kind the same way (``deploy/k8s``: items renamed to ``ca.pem``,
``<role>.pem``, ``<role>-key.pem``). When every Secret exists nothing changes; otherwise all are written
afresh from one new CA (Secrets of two CAs would not trust each other). The CA key is not kept.

etcd's two Secrets come from a CA of their own (``rpc/certs.etcd_pems``), so that etcd admits the manager
and no other holder of a cluster certificate: ``<prefix>-etcd`` (what the etcd members serve and peer
with) and ``<prefix>-manager-etcd`` (the manager's etcd client certificate). They are a second group,
made the same way (all of the group, or none), so an existing mesh gains them without being re-keyed.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence

from infinite_llm.rpc.certs import (
    DEFAULT_DAYS,
    ETCD_CLIENT,
    ETCD_SERVER,
    cert_pem,
    etcd_pems,
    key_pem,
    make_ca,
    make_leaf,
)
from infinite_llm.rpc.tls import ROLES

log = logging.getLogger(__name__)
DEFAULT_PREFIX = "infinite-llm-tls"
SERVICES = ("manager", "router", "compute", "attention", "gateway")  # the Services of deploy/k8s/base
ETCD_SECRETS = {ETCD_SERVER: "etcd", ETCD_CLIENT: "manager-etcd"}  # file stem -> Secret name after the prefix


def service_hosts(namespace: str) -> list[str]:
    """DNS names of the mesh's Services (and attention pods) in ``namespace``, for tools that dial them by
    name without the mesh's name override (the mesh's own channels check ``infinite-llm.mesh``)."""
    hosts = []
    for s in SERVICES:
        hosts += [s, f"{s}.{namespace}", f"{s}.{namespace}.svc", f"{s}.{namespace}.svc.cluster.local"]
    return [*hosts, f"*.attention.{namespace}.svc", f"*.attention.{namespace}.svc.cluster.local"]


def etcd_hosts(namespace: str) -> list[str]:
    """DNS names the etcd members' certificate needs in ``namespace``: the Services the manager dials and
    the members' own names (``etcd-N.etcd.<ns>.svc``), which their peers check."""
    hosts = []
    for s in ("etcd-client", "etcd"):
        hosts += [s, f"{s}.{namespace}", f"{s}.{namespace}.svc", f"{s}.{namespace}.svc.cluster.local"]
    return [*hosts, f"*.etcd.{namespace}.svc", f"*.etcd.{namespace}.svc.cluster.local"]


def _tls_secret(name: str, namespace: str, component: str, ca: bytes, cert: bytes, key: bytes) -> dict:
    data = {"ca.crt": ca, "tls.crt": cert, "tls.key": key}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "infinite-llm", "app.kubernetes.io/component": component},
        },
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def role_secrets(namespace: str, prefix: str = DEFAULT_PREFIX, days: int = DEFAULT_DAYS) -> dict[str, dict]:
    """``{name: Secret manifest}``, one per role, signed by one new CA."""
    ca_cert, ca_key = make_ca(days=days)
    secrets = {}
    for role in ROLES:
        cert, key = make_leaf(role, ca_cert, ca_key, service_hosts(namespace), days)
        name = f"{prefix}-{role}"
        secrets[name] = _tls_secret(name, namespace, f"tls-{role}", cert_pem(ca_cert), cert_pem(cert), key_pem(key))
    return secrets


def etcd_secrets(namespace: str, prefix: str = DEFAULT_PREFIX, days: int = DEFAULT_DAYS) -> dict[str, dict]:
    """``{name: Secret manifest}`` of etcd's certificate and the manager's etcd client certificate, signed by
    one new etcd CA (not the cluster CA)."""
    ca, pems = etcd_pems(etcd_hosts(namespace), days)
    secrets = {}
    for stem, suffix in ETCD_SECRETS.items():
        name = f"{prefix}-{suffix}"
        secrets[name] = _tls_secret(name, namespace, f"tls-{suffix}", ca, *pems[stem])
    return secrets


def ensure_role_secrets(core_api, namespace: str, prefix: str = DEFAULT_PREFIX, roles: Sequence[str] = ROLES) -> bool:  # noqa: ANN001
    """Create the role Secrets unless all exist (then replace any that do, from the same new CA), and
    etcd's Secrets likewise (from another new CA). Returns whether anything was written. ``core_api``: a
    ``kubernetes.client.CoreV1Api``."""
    wrote_roles = _ensure_group(
        core_api, namespace, [f"{prefix}-{r}" for r in roles], lambda: role_secrets(namespace, prefix)
    )
    etcd_names = [f"{prefix}-{suffix}" for suffix in ETCD_SECRETS.values()]
    wrote_etcd = _ensure_group(core_api, namespace, etcd_names, lambda: etcd_secrets(namespace, prefix))
    return wrote_roles or wrote_etcd


def _ensure_group(core_api, namespace: str, names: list[str], make: Callable[[], dict[str, dict]]) -> bool:  # noqa: ANN001
    """Write the Secrets ``make`` returns unless every one of ``names`` exists; whether it wrote."""
    from kubernetes.client.exceptions import ApiException

    existing = set()
    for name in names:
        try:
            core_api.read_namespaced_secret(name, namespace)
            existing.add(name)
        except ApiException as e:
            if e.status != 404:
                raise
    if len(existing) == len(names):
        log.info("the %d Secrets %s exist in %s; nothing to do", len(names), ", ".join(names), namespace)
        return False
    for name, body in make().items():
        if name in existing:
            core_api.replace_namespaced_secret(name, namespace, body)
        else:
            core_api.create_namespaced_secret(namespace, body)
        log.info("wrote Secret %s/%s", namespace, name)
    return True
