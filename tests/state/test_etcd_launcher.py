"""The etcd launcher starts a real, healthy server on loopback and cleans up after it."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.rpc.certs import write_etcd_tls_dir, write_tls_dir
from infinite_llm.rpc.tls import TlsConfig, load_tls_dir, tls_files
from infinite_llm.state.etcd_launcher import EtcdTls, find_etcd_binary, start_etcd
from infinite_llm.state.etcd_store import EtcdStore


def test_binary_is_found_next_to_the_interpreter():
    assert find_etcd_binary() == Path(sys.executable).parent / "etcd"


def test_server_is_healthy_then_stopped_with_its_temporary_dir_removed():
    server = start_etcd()
    with server:
        assert server.is_healthy()
        assert server.endpoint == f"http://127.0.0.1:{server.client_port}"
        assert server.data_dir.is_dir()
    assert server.process.poll() is not None
    assert not server.is_healthy(timeout_s=0.2)
    assert not server.data_dir.exists()


def test_a_given_data_dir_is_kept_after_stop(tmp_path):
    with start_etcd(data_dir=tmp_path / "state") as server:
        assert server.is_healthy()
    assert (tmp_path / "state" / "etcd" / "member").is_dir()
    assert (tmp_path / "state" / "etcd.log").is_file()


def test_a_tls_etcd_admits_only_the_managers_etcd_certificate(tmp_path):
    """``infinite-llm up``'s etcd (issue 11: "etcd itself is open"), with etcd's own CA: the manager's etcd
    certificate reads and writes. Refused (``Unavailable``): plaintext; the cluster certificates of a
    compute instance, a router and the manager itself, even presented by a client that trusts etcd's CA
    (so etcd, not the client, refuses them); a manager certificate of another etcd CA."""
    cluster = write_tls_dir(tmp_path / "cluster")
    etcd_dir, other = write_etcd_tls_dir(tmp_path / "etcd"), write_etcd_tls_dir(tmp_path / "other")
    manager = load_tls_dir(etcd_dir, "manager", server_name=None)  # what serve manager --etcd-tls-dir loads
    etcd_ca = (etcd_dir / "ca.pem").read_bytes()

    def cluster_cert(role: str) -> TlsConfig:
        return dataclasses.replace(load_tls_dir(cluster, role), ca_pem=etcd_ca, server_name=None)

    with start_etcd(tls=EtcdTls.from_etcd_tls_dir(etcd_dir)) as server:
        assert server.endpoint == f"https://127.0.0.1:{server.client_port}" and server.is_healthy()
        assert asyncio.run(_put_get(server, manager)) == b"v"
        refused = [cluster_cert(role) for role in ("compute", "router", "manager")]
        refused += [None, dataclasses.replace(load_tls_dir(other, "manager", server_name=None), ca_pem=etcd_ca)]
        for tls in refused:
            with pytest.raises(Unavailable):
                asyncio.run(_put_get(server, tls))
        assert asyncio.run(_put_get(server, manager)) == b"v"  # still serving the manager
        deadline = time.monotonic() + 5  # etcd logs the rejection just after it
        while "tls: failed to verify client certificate" not in server.log_path.read_text():  # etcd refused them
            assert time.monotonic() < deadline, server.log_path.read_text()[-2000:]
            time.sleep(0.1)
        assert not dataclasses.replace(server, tls=None).is_healthy(timeout_s=1.0)  # plain HTTP gets nothing
        cluster_etcd = EtcdTls(*tls_files(cluster, "compute"))  # a compute's files with the cluster CA
        assert not dataclasses.replace(server, tls=cluster_etcd).is_healthy(timeout_s=1.0)


def test_the_etcd_tls_dir_names_its_files_like_a_tls_dir(tmp_path):
    """``ca.pem`` is etcd's CA, not the cluster's; ``etcd.pem`` serves (and is a client to peers);
    ``manager.pem`` is a client certificate only, named ``manager``; keys are private (0600)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = write_etcd_tls_dir(tmp_path / "etcd", hosts=("etcd-client", "*.etcd.ns.svc"))
    assert sorted(p.name for p in directory.iterdir()) == [
        "ca.pem",
        "etcd-key.pem",
        "etcd.pem",
        "manager-key.pem",
        "manager.pem",
    ]
    assert {(directory / f).stat().st_mode & 0o777 for f in ("etcd-key.pem", "manager-key.pem")} == {0o600}
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "infinite-llm etcd CA"
    certs = {s: x509.load_pem_x509_certificate((directory / f"{s}.pem").read_bytes()) for s in ("etcd", "manager")}
    usages = {s: set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) for s, c in certs.items()}
    assert usages == {
        "etcd": {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH},
        "manager": {ExtendedKeyUsageOID.CLIENT_AUTH},
    }
    assert all(c.issuer == ca.subject for c in certs.values())
    names = certs["etcd"].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "etcd-client", "*.etcd.ns.svc"]
    assert certs["manager"].subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "manager"


async def _put_get(server, tls: TlsConfig | None) -> bytes:  # noqa: ANN001
    store = EtcdStore(server.host, server.client_port, prefix="/tls-test/", timeout_s=3.0, tls=tls)
    await store.connect()
    try:
        await store.put("k", b"v")
        return (await store.get("k")).value
    finally:
        await store.close()
