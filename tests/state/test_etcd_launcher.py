"""The etcd launcher starts a real, healthy server on loopback and cleans up after it."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.rpc.certs import write_tls_dir
from infinite_llm.rpc.tls import TlsConfig, load_tls_dir
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


def test_a_tls_etcd_admits_only_clients_with_a_certificate_of_the_cluster_ca(tmp_path):
    """``infinite-llm up``'s etcd (issue 11: "etcd itself is open"): the manager's certificate reads and
    writes; plaintext, and a valid certificate of another CA, are refused (``Unavailable``)."""
    cluster, other = write_tls_dir(tmp_path / "cluster"), write_tls_dir(tmp_path / "other")

    async def put_get(tls: TlsConfig | None) -> bytes:
        store = EtcdStore(server.host, server.client_port, prefix="/tls-test/", timeout_s=3.0, tls=tls)
        await store.connect()
        try:
            await store.put("k", b"v")
            return (await store.get("k")).value
        finally:
            await store.close()

    with start_etcd(tls=EtcdTls.from_tls_dir(cluster)) as server:
        assert server.endpoint == f"https://127.0.0.1:{server.client_port}" and server.is_healthy()
        assert asyncio.run(put_get(load_tls_dir(cluster, "manager"))) == b"v"
        for refused in (None, load_tls_dir(other, "manager")):
            with pytest.raises(Unavailable):
                asyncio.run(put_get(refused))
        assert not dataclasses.replace(server, tls=None).is_healthy(timeout_s=1.0)  # plain HTTP gets nothing
