"""The etcd launcher starts a real, healthy server on loopback and cleans up after it."""

from __future__ import annotations

import sys
from pathlib import Path

from infinite_llm.state.etcd_launcher import find_etcd_binary, start_etcd


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
