"""The dev cluster's certificates: one Kubernetes Secret per role, made once by the ``tls-bootstrap`` Job
(``infinite-llm tls k8s-secrets``) of the dev overlay. Production gets the same Secrets from cert-manager.

Each Secret ``<prefix>-<role>`` is ``kubernetes.io/tls`` with cert-manager's keys (``ca.crt``, ``tls.crt``,
``tls.key``), so pods mount either kind the same way (``deploy/k8s``: items renamed to ``ca.pem``,
``<role>.pem``, ``<role>-key.pem``). When every Secret exists nothing changes; otherwise all are written
afresh from one new CA (Secrets of two CAs would not trust each other). The CA key is not kept.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence

from infinite_llm.rpc.certs import DEFAULT_DAYS, cert_pem, key_pem, make_ca, make_leaf
from infinite_llm.rpc.tls import ROLES

log = logging.getLogger(__name__)
DEFAULT_PREFIX = "infinite-llm-tls"
SERVICES = ("manager", "router", "compute", "attention", "gateway")  # the Services of deploy/k8s/base


def service_hosts(namespace: str) -> list[str]:
    """DNS names of the mesh's Services (and attention pods) in ``namespace``, for tools that dial them by
    name without the mesh's name override (the mesh's own channels check ``infinite-llm.mesh``)."""
    hosts = []
    for s in SERVICES:
        hosts += [s, f"{s}.{namespace}", f"{s}.{namespace}.svc", f"{s}.{namespace}.svc.cluster.local"]
    return [*hosts, f"*.attention.{namespace}.svc", f"*.attention.{namespace}.svc.cluster.local"]


def role_secrets(namespace: str, prefix: str = DEFAULT_PREFIX, days: int = DEFAULT_DAYS) -> dict[str, dict]:
    """``{name: Secret manifest}``, one per role, signed by one new CA."""
    ca_cert, ca_key = make_ca(days=days)
    secrets = {}
    for role in ROLES:
        cert, key = make_leaf(role, ca_cert, ca_key, service_hosts(namespace), days)
        data = {"ca.crt": cert_pem(ca_cert), "tls.crt": cert_pem(cert), "tls.key": key_pem(key)}
        name = f"{prefix}-{role}"
        secrets[name] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/name": "infinite-llm", "app.kubernetes.io/component": f"tls-{role}"},
            },
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
    return secrets


def ensure_role_secrets(core_api, namespace: str, prefix: str = DEFAULT_PREFIX, roles: Sequence[str] = ROLES) -> bool:  # noqa: ANN001
    """Create the role Secrets unless all exist (then replace any that do, from the same new CA).
    Returns whether anything was written. ``core_api``: a ``kubernetes.client.CoreV1Api``."""
    from kubernetes.client.exceptions import ApiException

    existing = set()
    for role in roles:
        try:
            core_api.read_namespaced_secret(f"{prefix}-{role}", namespace)
            existing.add(f"{prefix}-{role}")
        except ApiException as e:
            if e.status != 404:
                raise
    if len(existing) == len(roles):
        log.info("the %d role Secrets exist in %s; nothing to do", len(roles), namespace)
        return False
    for name, body in role_secrets(namespace, prefix).items():
        if name in existing:
            core_api.replace_namespaced_secret(name, namespace, body)
        else:
            core_api.create_namespaced_secret(namespace, body)
        log.info("wrote Secret %s/%s", namespace, name)
    return True
