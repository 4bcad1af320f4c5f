"""mTLS in every render: each gRPC service and the gateway mount their role's Secret read-only where
``--tls-dir`` (INFINITE_LLM_TLS_DIR) points; dev and gpu make the Secrets with the tls-bootstrap Job,
production with cert-manager Certificates of one CA. The Secrets the Job writes, mounted as the manifests
say, give certificates that really complete an mTLS handshake with the right roles."""

from __future__ import annotations

import base64

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.rpc.k8s_secrets import role_secrets
from infinite_llm.rpc.tls import CLIENT_ROLES, ROLES, load_tls_dir

from .conftest import RENDERS
from .manifests import by_kind, config_data, main_container, one, pod_labels, pod_spec, workloads

ROLE_OF = {"manager": "manager", "attention-server": "attention", "compute": "compute", "router": "router"}
ROLE_OF["gateway"] = "gateway"
SECRETS = {f"infinite-llm-tls-{r}" for r in ROLES}
ETCD_SECRETS = ["infinite-llm-tls-etcd", "infinite-llm-tls-manager-etcd"]  # etcd's own CA: test_etcd_tls.py


def tls_volume(workload: dict) -> dict:
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == "tls"]
    return volume


@pytest.mark.parametrize("render", RENDERS)
@pytest.mark.parametrize("component", sorted(ROLE_OF))
def test_each_service_mounts_its_roles_secret_read_only_at_its_tls_dir(rendered, render, component):
    (w,) = [w for w in workloads(rendered[render]) if pod_labels(w)["app.kubernetes.io/component"] == component]
    role, c = ROLE_OF[component], main_container(w)
    secret = tls_volume(w)["secret"]
    assert secret["secretName"] == f"infinite-llm-tls-{role}"
    assert secret["defaultMode"] == 0o440  # the pod's group (fsGroup) reads; nobody writes
    assert {i["key"]: i["path"] for i in secret["items"]} == {
        "ca.crt": "ca.pem",
        "tls.crt": f"{role}.pem",
        "tls.key": f"{role}-key.pem",
    }
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] is True and "subPath" not in mount  # subPath mounts never see a renewal
    data = config_data(rendered[render], c)
    assert data["INFINITE_LLM_TLS_DIR"] == mount["mountPath"]
    assert not any(a.startswith("--insecure") for a in c["args"])
    init_mounts = [m["name"] for i in pod_spec(w).get("initContainers", []) for m in i["volumeMounts"]]
    assert "tls" not in init_mounts  # only the service holds its key


@pytest.mark.parametrize("render", RENDERS)
def test_no_pod_mounts_the_ca_key(rendered, render):
    for w in workloads(rendered[render]) + by_kind(rendered[render], "Job"):
        names = {v.get("secret", {}).get("secretName") for v in pod_spec(w).get("volumes", [])}
        assert "infinite-llm-ca" not in names, w["metadata"]["name"]


@pytest.mark.parametrize("render", [r for r in RENDERS if r != "production"])
def test_dev_and_gpu_make_the_secrets_with_the_bootstrap_job(rendered, render):
    from typer.main import get_command

    from infinite_llm.cli import app

    docs = rendered[render]
    job = one(docs, "Job", "tls-bootstrap")
    spec = pod_spec(job)
    c = main_container(job)
    assert c["args"] == ["tls", "k8s-secrets"]
    assert "k8s-secrets" in get_command(app).commands["tls"].commands  # the image's CLI has it
    assert spec["serviceAccountName"] == "tls-bootstrap" and spec["automountServiceAccountToken"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"]
    assert c["env"] == [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    rules = one(docs, "Role", "tls-bootstrap")["rules"]
    assert rules == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [*sorted(SECRETS, key=_role_order), *ETCD_SECRETS],
            "verbs": ["get", "update"],
        },
    ]
    binding = one(docs, "RoleBinding", "tls-bootstrap")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tls-bootstrap", "namespace": "infinite-llm"}]
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io")]


def _role_order(secret: str) -> int:
    return ROLES.index(secret.removeprefix("infinite-llm-tls-"))


def test_production_gets_one_certificate_per_role_from_one_ca(rendered):
    docs = rendered["production"]
    assert not by_kind(docs, "Job")
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    assert all(d["metadata"]["namespace"] == "infinite-llm" for d in docs if d["apiVersion"] == "cert-manager.io/v1")
    ca = certs.pop("infinite-llm-ca")
    for name in ("infinite-llm-etcd-ca", *ETCD_SECRETS):  # etcd's own CA and what it signs: test_etcd_tls.py
        certs.pop(name)
    assert ca["isCA"] is True and issuers["infinite-llm-selfsigned"] == {"selfSigned": {}}
    assert ca["issuerRef"]["name"] == "infinite-llm-selfsigned"
    assert issuers["infinite-llm-ca"] == {"ca": {"secretName": ca["secretName"]}}
    assert {c["secretName"] for c in certs.values()} == SECRETS
    for spec in certs.values():
        role = spec["commonName"]
        assert spec["secretName"] == f"infinite-llm-tls-{role}"
        assert spec["uris"] == [f"spiffe://infinite-llm/role/{role}"]
        assert spec["issuerRef"] == {"group": "cert-manager.io", "kind": "Issuer", "name": "infinite-llm-ca"}
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        serves = role not in CLIENT_ROLES
        assert ("server auth" in spec["usages"]) is serves and "client auth" in spec["usages"]
        assert ("infinite-llm.mesh" in spec.get("dnsNames", [])) is serves
    assert certs["infinite-llm-tls-manager"]["dnsNames"][2:4] == ["manager", "manager.infinite-llm"]


def _mounted(secret: dict, role: str, directory) -> None:  # noqa: ANN001
    """Write ``secret`` as the pod sees it: the manifests' items, decoded."""
    data = secret["data"]
    files = {"ca.pem": "ca.crt", f"{role}.pem": "tls.crt", f"{role}-key.pem": "tls.key"}
    for path, key in files.items():
        (directory / path).write_bytes(base64.b64decode(data[key]))


def test_the_bootstrap_secrets_complete_an_mtls_handshake_with_roles(tmp_path):
    """The Secrets the Job writes, mounted as in the pods: the router's certificate serves, the client's
    dials and is seen as role ``client``; a client certificate of another run's CA is refused."""
    import asyncio

    from infinite_llm.pb.v1 import router_pb2, router_pb2_grpc
    from infinite_llm.rpc.server import Service, start_server

    secrets = role_secrets("infinite-llm")
    assert set(secrets) == SECRETS
    for role in ("router", "client"):
        (tmp_path / role).mkdir()
        _mounted(secrets[f"infinite-llm-tls-{role}"], role, tmp_path / role)
    other = tmp_path / "other"
    other.mkdir()
    _mounted(role_secrets("infinite-llm")["infinite-llm-tls-client"], "client", other)

    async def scenario() -> tuple[int, int]:
        service = Service.of(
            router_pb2, "Router", router_pb2_grpc.add_RouterServicer_to_server, router_pb2_grpc.RouterServicer()
        )
        server = await start_server([service], tls=load_tls_dir(tmp_path / "router", "router"))
        try:
            return tuple([await _health(server.port, tmp_path / "client"), await _health(server.port, other)])
        finally:
            await server.stop(0)

    ok, refused = asyncio.run(scenario())
    assert ok == health_pb2.HealthCheckResponse.SERVING
    assert refused == grpc.StatusCode.UNAVAILABLE


async def _health(port: int, directory) -> int | grpc.StatusCode:  # noqa: ANN001
    tls = load_tls_dir(directory, "client")
    options = tls.channel_options()
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls.channel_credentials(), options=options) as ch:
        try:
            return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        except grpc.aio.AioRpcError as e:
            return e.code()
