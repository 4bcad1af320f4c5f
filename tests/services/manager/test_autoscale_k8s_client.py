"""``k8s_client`` through the real ``kubernetes`` client against a stand-in API server on loopback: the exact
requests (paths, merge-patch body and content type), error mapping, and the in-cluster requirement."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from infinite_llm.core.errors import Unavailable
from infinite_llm.services.manager.autoscale import KubernetesScaler

SCALE_PATH = "/apis/apps/v1/namespaces/llm/statefulsets/attention/scale"


class FakeApiServer:
    """Serves the scale subresource of StatefulSet llm/attention; records every request."""

    def __init__(self) -> None:
        self.replicas, self.requests, self.status = 2, [], 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((self.command, self.path, self.headers.get("Content-Type"), body))
                if fake.status != 200 or self.path != SCALE_PATH:
                    code = fake.status if fake.status != 200 else 404
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(json.dumps({"kind": "Status", "code": code}).encode())
                    return
                if self.command == "PATCH":
                    fake.replicas = body["spec"]["replicas"]
                scale = {
                    "apiVersion": "autoscaling/v1",
                    "kind": "Scale",
                    "metadata": {"name": "attention", "namespace": "llm"},
                    "spec": {"replicas": fake.replicas},
                    "status": {"replicas": fake.replicas},
                }
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(scale).encode())

            do_GET = do_PATCH = _reply

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def api_server():
    server = FakeApiServer()
    yield server
    server.close()


def scaler_for(server: FakeApiServer, name: str = "attention") -> KubernetesScaler:
    config = client.Configuration(host=server.url)
    return KubernetesScaler(name, "llm", client.AppsV1Api(client.ApiClient(config)))


def test_reads_and_sets_replicas_through_the_scale_subresource(api_server):
    scaler = scaler_for(api_server)
    assert scaler.get_replicas() == 2
    scaler.set_replicas(3)
    assert scaler.get_replicas() == 3
    assert api_server.requests == [
        ("GET", SCALE_PATH, None, None),
        ("PATCH", SCALE_PATH, "application/merge-patch+json", {"spec": {"replicas": 3}}),
        ("GET", SCALE_PATH, None, None),
    ]


def test_api_errors_become_unavailable_naming_the_call(api_server):
    api_server.status = 403
    with pytest.raises(
        Unavailable,
        match=r"patch_namespaced_stateful_set_scale on statefulsets/attention/scale "
        r"in namespace 'llm' failed: HTTP 403",
    ):
        scaler_for(api_server).set_replicas(1)
    api_server.status = 200
    with pytest.raises(Unavailable, match=r"read_namespaced_stateful_set_scale on statefulsets/other/scale .*404"):
        scaler_for(api_server, "other").get_replicas()


def test_unreachable_api_server_becomes_unavailable(api_server):
    scaler = scaler_for(api_server)
    api_server.close()
    with pytest.raises(Unavailable, match="read_namespaced_stateful_set_scale"):
        scaler.get_replicas()


def test_negative_replicas_are_refused_before_any_call(api_server):
    with pytest.raises(ValueError, match="replicas must be >= 0, got -1"):
        scaler_for(api_server).set_replicas(-1)
    assert api_server.requests == []


def test_in_cluster_config_is_required(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(Unavailable, match="needs the in-cluster Kubernetes config .*: Service host/port is not set"):
        KubernetesScaler.in_cluster("attention")


def test_in_cluster_uses_the_pods_service_account_and_namespace(monkeypatch, tmp_path):
    """What a pod has: the API address in env, the token, CA and namespace in the service-account volume."""
    from kubernetes.config import incluster_config

    from infinite_llm.services.manager.autoscale import k8s_client

    for name, text in (("token", "secret-token"), ("ca.crt", "not-checked-here"), ("namespace", "llm\n")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr(k8s_client, "NAMESPACE_FILE", tmp_path / "namespace")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    previous = client.Configuration.get_default_copy()
    try:
        scaler = KubernetesScaler.in_cluster("attention")
        assert (scaler.name, scaler.namespace) == ("attention", "llm")
        assert KubernetesScaler.in_cluster("attention", "other").namespace == "other"
        config = client.Configuration.get_default_copy()
        assert config.host == "https://10.96.0.1:443"
        assert config.api_key == {"BearerToken": "bearer secret-token"}
    finally:
        client.Configuration.set_default(previous)
