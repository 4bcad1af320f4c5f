"""The tls-bootstrap Job's Secrets (``infinite-llm tls k8s-secrets``): the role Secrets from the cluster CA and
etcd's two from a CA of its own are two groups, each written whole (from one new CA) unless all of it exists,
so a mesh made before etcd had TLS gains etcd's Secrets without its roles being re-keyed."""

from __future__ import annotations

import base64

from cryptography import x509
from kubernetes.client.exceptions import ApiException

from infinite_llm.rpc.k8s_secrets import ensure_role_secrets, etcd_secrets, role_secrets
from infinite_llm.rpc.tls import ROLES

NS = "infinite-llm"
ROLE_SECRETS = [f"infinite-llm-tls-{r}" for r in ROLES]
ETCD_SECRETS = ["infinite-llm-tls-etcd", "infinite-llm-tls-manager-etcd"]


class FakeCoreApi:
    """The three calls ensure_role_secrets makes, on a dict of Secrets."""

    def __init__(self, secrets: dict[str, dict]) -> None:
        self.secrets, self.calls = dict(secrets), []

    def read_namespaced_secret(self, name: str, namespace: str) -> dict:
        if name not in self.secrets:
            raise ApiException(status=404)
        return self.secrets[name]

    def create_namespaced_secret(self, namespace: str, body: dict) -> None:
        self.calls.append(("create", body["metadata"]["name"]))
        self.secrets[body["metadata"]["name"]] = body

    def replace_namespaced_secret(self, name: str, namespace: str, body: dict) -> None:
        self.calls.append(("replace", name))
        self.secrets[name] = body


def ca_of(secret: dict) -> bytes:
    return base64.b64decode(secret["data"]["ca.crt"])


def test_a_mesh_without_etcds_secrets_gains_them_and_keeps_its_role_certificates():
    api = FakeCoreApi(role_secrets(NS))
    before = dict(api.secrets)
    assert ensure_role_secrets(api, NS) is True
    assert api.calls == [("create", name) for name in ETCD_SECRETS]
    assert all(api.secrets[name] is before[name] for name in ROLE_SECRETS)  # not re-keyed
    etcd_ca = {ca_of(api.secrets[name]) for name in ETCD_SECRETS}
    assert len(etcd_ca) == 1 and etcd_ca.isdisjoint({ca_of(before[n]) for n in ROLE_SECRETS})
    assert ensure_role_secrets(api, NS) is False and len(api.calls) == 2  # all there: nothing to do


def test_a_partial_etcd_group_is_written_whole_from_one_new_ca():
    stale = etcd_secrets(NS)["infinite-llm-tls-etcd"]
    api = FakeCoreApi({**role_secrets(NS), "infinite-llm-tls-etcd": stale})
    assert ensure_role_secrets(api, NS) is True
    assert api.calls == [("replace", "infinite-llm-tls-etcd"), ("create", "infinite-llm-tls-manager-etcd")]
    server, client = (api.secrets[name] for name in ETCD_SECRETS)
    assert ca_of(server) == ca_of(client) != ca_of(stale)


def test_etcds_secrets_hold_its_certificate_and_the_managers_etcd_client_certificate():
    secrets = etcd_secrets(NS)
    assert sorted(secrets) == ETCD_SECRETS
    certs = {n: x509.load_pem_x509_certificate(base64.b64decode(s["data"]["tls.crt"])) for n, s in secrets.items()}
    server, client = certs["infinite-llm-tls-etcd"], certs["infinite-llm-tls-manager-etcd"]
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    assert {"etcd-client", f"etcd-client.{NS}.svc", f"*.etcd.{NS}.svc", f"*.etcd.{NS}.svc.cluster.local"} <= set(dns)
    assert client.subject.rfc4514_string() == "CN=manager,O=infinite-llm"
    assert all(s["type"] == "kubernetes.io/tls" and s["metadata"]["namespace"] == NS for s in secrets.values())
