"""The only code that talks to the Kubernetes API: read and set the attention StatefulSet's replicas.

It uses the ``scale`` subresource (``get`` and ``patch`` on ``statefulsets/scale``, which is all the
manager's Role grants) through the official ``kubernetes`` client with in-cluster config (the pod's
service-account token). Calls block: the controller runs them in a worker thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from infinite_llm.core.errors import Unavailable

log = logging.getLogger(__name__)
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# The generated client would send a dict body as application/json-patch+json (the first JSON type the
# API lists), which the API server rejects for a non-list body: name the merge patch explicitly.
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 10.0


class StatefulSetScaler(Protocol):
    """Reads and sets one StatefulSet's desired replicas. Both raise ``Unavailable`` on API failure."""

    def get_replicas(self) -> int: ...

    def set_replicas(self, replicas: int) -> None: ...


class KubernetesScaler:
    """:class:`StatefulSetScaler` over ``AppsV1Api`` for StatefulSet ``name`` in ``namespace``."""

    def __init__(self, name: str, namespace: str, apps_api) -> None:  # noqa: ANN001  (kubernetes.client.AppsV1Api)
        self.name, self.namespace = name, namespace
        self._api = apps_api

    @classmethod
    def in_cluster(cls, name: str, namespace: str = "") -> KubernetesScaler:
        """Configure from the pod's service account; ``namespace`` defaults to the pod's own.

        Raises:
            Unavailable: not running in a Kubernetes pod (no service-account token or API address).
        """
        from kubernetes import client, config

        try:
            config.load_incluster_config()
            namespace = namespace or NAMESPACE_FILE.read_text().strip()
        except (config.ConfigException, OSError) as e:
            raise Unavailable(
                f"scaling StatefulSet {name!r} needs the in-cluster Kubernetes config of a pod with a "
                f"service account: {e}"
            ) from None
        log.info("Kubernetes API in cluster; StatefulSet %s in namespace %s", name, namespace)
        return cls(name, namespace, client.AppsV1Api())

    def get_replicas(self) -> int:
        """``spec.replicas`` of the StatefulSet's scale subresource."""
        scale = self._call(self._api.read_namespaced_stateful_set_scale, self.name, self.namespace)
        return int(scale.spec.replicas or 0)

    def set_replicas(self, replicas: int) -> None:
        """Set ``spec.replicas`` (a merge patch of the scale subresource)."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self._call(
            self._api.patch_namespaced_stateful_set_scale,
            self.name,
            self.namespace,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE_PATCH,
        )

    def _call(self, method, *args, **kwargs):  # noqa: ANN001, ANN202
        from kubernetes.client.exceptions import OpenApiException
        from urllib3.exceptions import HTTPError

        try:
            return method(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except (OpenApiException, HTTPError) as e:
            what = f"statefulsets/{self.name}/scale in namespace {self.namespace!r}"
            raise Unavailable(f"Kubernetes API call {method.__name__} on {what} failed: {_short(e)}") from None


def _short(e: Exception) -> str:
    status, reason = getattr(e, "status", None), getattr(e, "reason", None)
    return f"HTTP {status} {reason}" if status else str(e).splitlines()[0]
