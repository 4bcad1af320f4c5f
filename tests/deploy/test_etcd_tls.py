"""etcd in every render serves TLS and admits only the manager (issue 11: "etcd itself is open").

etcd trusts a CA of its own (Secret ``infinite-llm-tls-etcd``: cert-manager in production, the
tls-bootstrap Job elsewhere), which signs only etcd's certificate and the manager's etcd client certificate
(``infinite-llm-tls-manager-etcd``); a certificate of the cluster CA, which every other role holds, is
refused. The offline checks read the rendered manifests; the last test runs the REAL etcd binary with the
dev render's etcd environment and the Secrets the Job makes, mounted as the manifests say.
"""

from __future__ import annotations

import pytest

from infinite_llm.rpc.k8s_secrets import etcd_hosts, etcd_secrets, role_secrets
from infinite_llm.services.manager.server import ManagerServerConfig

from .conftest import RENDERS
from .manifests import by_kind, config_data, expand, main_container, one, pod_spec, workloads

NS = "infinite-llm"
ETCD_SECRET, MANAGER_ETCD_SECRET = "infinite-llm-tls-etcd", "infinite-llm-tls-manager-etcd"
ETCD_POD = {"POD_NAME": "etcd-0", "POD_NAMESPACE": NS}  # what the downward API gives member 0
WORKLOAD = {"compute": ("Deployment", "compute"), "router": ("Deployment", "router")}


def etcd_env(docs: list[dict]) -> dict[str, str]:
    """The etcd container's environment as member 0 sees it (downward API and ``$(VAR)`` resolved)."""
    env: dict[str, str] = {}
    for e in main_container(one(docs, "StatefulSet", "etcd"))["env"]:
        env[e["name"]] = ETCD_POD[e["name"]] if "valueFrom" in e else expand(e["value"], env)
    return env


def volume(workload: dict, name: str) -> dict:
    (found,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == name]
    return found


def mount_path(workload: dict, name: str) -> str:
    (mount,) = [m for m in main_container(workload)["volumeMounts"] if m["name"] == name]
    assert mount["readOnly"] is True and "subPath" not in mount  # subPath mounts never see a renewal
    return mount["mountPath"]


def secret_files(workload: dict, name: str) -> dict[str, str]:
    """``{key in the Secret: path in the mount}`` of a Secret volume."""
    return {i["key"]: i["path"] for i in volume(workload, name)["secret"]["items"]}


@pytest.mark.parametrize("render", RENDERS)
def test_etcd_serves_client_and_peer_tls_with_client_certificates_from_its_secret(rendered, render):
    docs = rendered[render]
    etcd = one(docs, "StatefulSet", "etcd")
    env, tls = etcd_env(docs), mount_path(etcd, "tls")
    secret = volume(etcd, "tls")["secret"]
    assert secret["secretName"] == ETCD_SECRET and secret["defaultMode"] == 0o440
    assert secret_files(etcd, "tls") == {"ca.crt": "ca.pem", "tls.crt": "etcd.pem", "tls.key": "etcd-key.pem"}
    files = {"TRUSTED_CA_FILE": f"{tls}/ca.pem", "CERT_FILE": f"{tls}/etcd.pem", "KEY_FILE": f"{tls}/etcd-key.pem"}
    for side in ("ETCD_", "ETCD_PEER_"):  # --client-cert-auth, --peer-client-cert-auth and their files
        assert env[f"{side}CLIENT_CERT_AUTH"] == "true"
        for key, path in files.items():
            assert env[side + key] == path, side + key
    assert not {"ETCD_AUTO_TLS", "ETCD_PEER_AUTO_TLS"} & set(env)  # certificates of etcd's CA, not self-made
    assert env["ETCD_LISTEN_CLIENT_URLS"] == "https://0.0.0.0:2379"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://etcd-0.etcd.{NS}.svc:2379"
    assert env["ETCD_LISTEN_PEER_URLS"] == "https://0.0.0.0:2380"
    assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"https://etcd-0.etcd.{NS}.svc:2380"
    peers = [entry.split("=", 1)[1] for entry in env["ETCD_INITIAL_CLUSTER"].split(",")]
    assert peers and all(p.startswith("https://") for p in peers)
    assert len(peers) == (3 if render == "production" else 1)


@pytest.mark.parametrize("render", RENDERS)
def test_etcd_probes_ask_the_plaintext_metrics_port_for_health(rendered, render):
    """kubelet presents no certificate: the probes use etcd's /health on --listen-metrics-urls (plain HTTP,
    no keys there), as kubeadm's etcd does; the client port stays TLS-only."""
    docs = rendered[render]
    c = main_container(one(docs, "StatefulSet", "etcd"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 2379, "peer": 2380, "metrics": 2381}
    assert etcd_env(docs)["ETCD_LISTEN_METRICS_URLS"] == f"http://0.0.0.0:{ports['metrics']}"
    paths = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]["httpGet"]
        assert probe["port"] == "metrics" and "scheme" not in probe, kind
        paths[kind] = probe["path"]
    assert paths == {
        "startupProbe": "/health?serializable=false",
        "readinessProbe": "/health?serializable=false",
        "livenessProbe": "/health?exclude=NOSPACE&serializable=true",  # this member alone: no restart on quorum loss
    }
    assert "appProtocol" not in str(one(docs, "Service", "etcd-client")["spec"]["ports"])  # not h2c any more


@pytest.mark.parametrize("render", RENDERS)
def test_the_manager_dials_etcd_over_https_with_its_etcd_certificate(rendered, render):
    docs = rendered[render]
    manager = one(docs, "Deployment", "manager")
    c = main_container(manager)
    endpoint = expand("$(ETCD_ENDPOINT)", config_data(docs, c))
    assert [a for a in c["args"] if a.startswith("--etcd=")] == ["--etcd=$(ETCD_ENDPOINT)"]
    assert endpoint == "https://etcd-client:2379"
    host, port = endpoint.removeprefix("https://").split(":")
    assert int(port) in [p["port"] for p in one(docs, "Service", host)["spec"]["ports"]]
    directory = mount_path(manager, "etcd-tls")
    assert [a for a in c["args"] if a.startswith("--etcd-tls-dir")] == [f"--etcd-tls-dir={directory}"]
    assert directory != mount_path(manager, "tls")
    secret = volume(manager, "etcd-tls")["secret"]
    assert secret["secretName"] == MANAGER_ETCD_SECRET and secret["defaultMode"] == 0o440
    assert secret_files(manager, "etcd-tls") == {
        "ca.crt": "ca.pem",
        "tls.crt": "manager.pem",
        "tls.key": "manager-key.pem",
    }
    assert ManagerServerConfig(etcd=endpoint, etcd_tls_dir=directory).etcd_tls_dir == directory  # a valid pair


@pytest.mark.parametrize("render", RENDERS)
def test_only_etcd_and_the_manager_mount_etcds_certificates(rendered, render):
    docs = rendered[render]
    mounted = {}
    for w in workloads(docs) + by_kind(docs, "Job"):
        for v in pod_spec(w).get("volumes", []):
            if "secret" in v:
                mounted.setdefault(v["secret"]["secretName"], []).append(w["metadata"]["name"])
    assert mounted[ETCD_SECRET] == ["etcd"] and mounted[MANAGER_ETCD_SECRET] == ["manager"]
    assert "infinite-llm-etcd-ca" not in mounted and "infinite-llm-ca" not in mounted


def test_production_signs_etcds_certificates_with_a_ca_of_their_own(rendered):
    docs = rendered["production"]
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    etcd_ca, cluster_ca = certs["infinite-llm-etcd-ca"], certs["infinite-llm-ca"]
    assert etcd_ca["isCA"] is True and etcd_ca["secretName"] != cluster_ca["secretName"]
    assert issuers["infinite-llm-etcd-ca"] == {"ca": {"secretName": etcd_ca["secretName"]}}
    signed = sorted(n for n, c in certs.items() if c["issuerRef"]["name"] == "infinite-llm-etcd-ca")
    assert signed == [ETCD_SECRET, MANAGER_ETCD_SECRET]  # nothing else holds a certificate etcd admits
    server, client = certs[ETCD_SECRET], certs[MANAGER_ETCD_SECRET]
    assert server["secretName"] == ETCD_SECRET and client["secretName"] == MANAGER_ETCD_SECRET
    assert set(server["usages"]) == {"digital signature", "client auth", "server auth"}  # peers are clients too
    assert set(client["usages"]) == {"digital signature", "client auth"}
    assert client["commonName"] == "manager" and "dnsNames" not in client
    # The names the Job's certificate has: the Service the manager dials, and each member's peer name.
    assert server["dnsNames"] == ["localhost", *etcd_hosts(NS)]
    env = etcd_env(docs)
    for url in [e.split("=", 1)[1] for e in env["ETCD_INITIAL_CLUSTER"].split(",")]:
        host = url.removeprefix("https://").split(":")[0]
        assert f"*.{host.split('.', 1)[1]}" in server["dnsNames"], host
    for d in docs:
        if d["kind"] in ("Certificate", "Issuer"):
            assert d["metadata"]["namespace"] == NS


@pytest.mark.parametrize("render", [r for r in RENDERS if r != "production"])
def test_the_bootstrap_job_may_write_etcds_secrets(rendered, render):
    (rule,) = [r for r in one(rendered[render], "Role", "tls-bootstrap")["rules"] if "resourceNames" in r]
    assert {ETCD_SECRET, MANAGER_ETCD_SECRET} <= set(rule["resourceNames"])
    made = etcd_secrets(NS)
    assert sorted(made) == [ETCD_SECRET, MANAGER_ETCD_SECRET]
    cas = {s["data"]["ca.crt"] for s in made.values()}
    assert len(cas) == 1 and cas.isdisjoint(s["data"]["ca.crt"] for s in role_secrets(NS).values())
