"""The REAL etcd binary run as the renders configure it: each member gets the rendered container's
environment (downward API and ``$(VAR)`` resolved, every ``ETCD_*`` variable one etcd knows) and the
Secrets the tls-bootstrap Job makes, written where the manifests mount them; only what a laptop needs is
changed (mount paths under a temporary directory, free ports on loopback, and the members' cluster DNS names
``etcd-N.etcd.<ns>.svc``, which resolve only in the cluster, ``localhost``). etcd then admits the manager's
etcd certificate and nobody else, its probes answer in plaintext, and production's three members form a
cluster over peer TLS (test_etcd_tls.py checks the same manifests offline)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.rpc.k8s_secrets import etcd_secrets, role_secrets
from infinite_llm.rpc.tls import TlsConfig, load_tls_dir
from infinite_llm.services.manager.server import ManagerServerConfig
from infinite_llm.state.etcd_launcher import find_etcd_binary, free_port
from infinite_llm.state.etcd_store import EtcdStore

from .manifests import config_data, expand, main_container, one, pod_spec
from .test_etcd_tls import ETCD_SECRET, MANAGER_ETCD_SECRET, NS

REFUSED = "tls: failed to verify client certificate"  # what etcd logs when it rejects a client's certificate


def mount(workload: dict, volume_name: str, secret: dict, root: Path) -> Path:
    """Write ``secret`` into ``root/<volume_name>`` as the workload's Secret volume lays it out."""
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == volume_name]
    directory = root / volume_name
    directory.mkdir(parents=True)
    for item in volume["secret"]["items"]:
        (directory / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
    return directory


@dataclasses.dataclass
class Member:
    """One etcd pod on this machine: its root (mounts, log) and ports by the container's port names."""

    root: Path
    ports: dict[str, int]
    process: subprocess.Popen | None = None

    @property
    def log(self) -> str:
        return (self.root / "etcd.log").read_text()

    def logged(self, text: str, timeout_s: float = 5.0) -> bool:
        """Whether ``text`` shows in the log within ``timeout_s`` (etcd logs a rejection just after it)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def healthy(self, path: str = "/health") -> bool:
        with contextlib.suppress(OSError, ValueError):
            return get(f"http://127.0.0.1:{self.ports['metrics']}{path}").get("health") == "true"
        return False


def member_env(etcd: dict, ordinal: int, members: list[Member]) -> dict[str, str]:
    """Member ``ordinal``'s rendered environment, moved onto this machine (see the module docstring)."""
    container = main_container(etcd)
    pod_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    pod = {"POD_NAME": f"etcd-{ordinal}", "POD_NAMESPACE": NS}
    me = members[ordinal]
    env: dict[str, str] = {}
    for e in container["env"]:
        value = pod[e["name"]] if "valueFrom" in e else expand(e["value"], env)
        env[e["name"]] = value
    local = {}
    for name, value in env.items():
        for m in container["volumeMounts"]:
            value = value.replace(m["mountPath"], str(me.root / m["name"]))
        for port_name, pod_port in pod_ports.items():
            for j, other in enumerate(members):
                value = value.replace(f"etcd-{j}.etcd.{NS}.svc:{pod_port}", f"localhost:{other.ports[port_name]}")
            value = value.replace(f"0.0.0.0:{pod_port}", f"127.0.0.1:{me.ports[port_name]}")
        local[name] = value
    return local


@contextlib.contextmanager
def rendered_etcd(docs: list[dict], secret: dict, root: Path, n_members: int = 1):
    """``n_members`` etcd members started as the render configures them, with etcd's ``secret``; yields
    them once each answers its probes' /health (a leader elected, over peer TLS when there are several)."""
    etcd = one(docs, "StatefulSet", "etcd")
    names = [p["name"] for p in main_container(etcd)["ports"]]
    members = [Member(root / f"etcd-{i}", {n: free_port() for n in names}) for i in range(n_members)]
    try:
        for i, m in enumerate(members):
            mount(etcd, "tls", secret, m.root)
            (m.root / "data").mkdir()
            with open(m.root / "etcd.log", "wb") as out:
                m.process = subprocess.Popen(
                    [str(find_etcd_binary())],
                    env={"PATH": os.environ.get("PATH", ""), **member_env(etcd, i, members)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
        deadline = time.monotonic() + 30
        for m in members:
            while not m.healthy():
                assert m.process.poll() is None and time.monotonic() < deadline, m.log[-3000:]
                time.sleep(0.2)
        yield members
    finally:
        for m in members:
            if m.process is not None:
                m.process.terminate()
        for m in members:
            if m.process is not None:
                m.process.wait(timeout=10)


def get(url: str, context: ssl.SSLContext | None = None) -> dict:
    with urllib.request.urlopen(url, timeout=3, context=context) as reply:
        return json.loads(reply.read())


def tls_context(directory: Path, stem: str, ca: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(directory / f"{stem}.pem"), str(directory / f"{stem}-key.pem"))
    return context


async def put_get(port: int, tls: TlsConfig | None, key: str = "probe", value: bytes | None = b"manager") -> bytes:
    """Write ``key`` (unless ``value`` is None) through the member on ``port``, then read it back there."""
    store = EtcdStore("127.0.0.1", port, prefix="/infinite-llm/", timeout_s=3.0, tls=tls)
    await store.connect()
    try:
        if value is not None:
            await store.put(key, value)
        return (await store.get(key)).value
    finally:
        await store.close()


def manager_identity(docs: list[dict], secret: dict, root: Path) -> TlsConfig:
    """What the rendered manager dials etcd with (its --etcd and --etcd-tls-dir, the Secret mounted), as it
    checks etcd's certificate: for the host of its endpoint, ``etcd-client`` (dialled here on loopback)."""
    manager = one(docs, "Deployment", "manager")
    c = main_container(manager)
    endpoint = expand("$(ETCD_ENDPOINT)", config_data(docs, c))
    directory = mount(manager, "etcd-tls", secret, root)
    (flag,) = [a for a in c["args"] if a.startswith("--etcd-tls-dir=")]
    assert flag == f"--etcd-tls-dir=/etc/infinite-llm/{directory.name}"
    tls = ManagerServerConfig(etcd=endpoint, etcd_tls_dir=str(directory)).etcd_identity()
    host = endpoint.removeprefix("https://").split(":")[0]
    assert tls.server_name is None and host == "etcd-client"  # the channel checks the host it dials
    return dataclasses.replace(tls, server_name=host)


def test_the_rendered_etcd_admits_the_managers_certificate_and_refuses_every_other(rendered, tmp_path):
    """dev's etcd: the probes' /health paths answer in plaintext on the metrics port; the manager's etcd
    certificate reads and writes; a compute's and a router's certificate of the cluster CA are refused by
    etcd itself (also from a client that trusts etcd's CA, so the client cannot be what refuses);
    plaintext gets nothing on the client and the peer port."""
    docs = rendered["dev"]
    roles, etcd_tls = role_secrets(NS), etcd_secrets(NS)  # one run of the tls-bootstrap Job
    as_manager = manager_identity(docs, etcd_tls[MANAGER_ETCD_SECRET], tmp_path / "manager")
    with rendered_etcd(docs, etcd_tls[ETCD_SECRET], tmp_path) as (member,):
        assert "unrecognized environment variable" not in member.log
        etcd = main_container(one(docs, "StatefulSet", "etcd"))
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert member.healthy(etcd[kind]["httpGet"]["path"]), kind

        assert asyncio.run(put_get(member.ports["grpc"], as_manager)) == b"manager"
        for role in ("compute", "router"):
            pod_files = load_tls_dir(
                mount(one(docs, "Deployment", role), "tls", roles[f"infinite-llm-tls-{role}"], tmp_path / role),
                role,
                server_name="etcd-client",
            )
            for tls in (pod_files, dataclasses.replace(pod_files, ca_pem=as_manager.ca_pem)):
                with pytest.raises(Unavailable):
                    asyncio.run(put_get(member.ports["grpc"], tls))
        assert member.logged(REFUSED)  # etcd itself refused them
        with pytest.raises(Unavailable):
            asyncio.run(put_get(member.ports["grpc"], None))
        for port in ("grpc", "peer"):
            with pytest.raises(OSError):
                get(f"http://127.0.0.1:{member.ports[port]}/version")
        assert asyncio.run(put_get(member.ports["grpc"], as_manager, value=None)) == b"manager"


def test_productions_three_members_form_a_cluster_over_peer_tls_and_refuse_other_peers(rendered, tmp_path):
    """production's etcd (three members, peer TLS with --peer-client-cert-auth): the members elect a leader
    over TLS, a write through member 0 is read through member 2, and the peer port refuses a cluster
    certificate (a compute's) while it answers a member's."""
    docs = rendered["production"]
    roles, etcd_tls = role_secrets(NS), etcd_secrets(NS)
    as_manager = manager_identity(docs, etcd_tls[MANAGER_ETCD_SECRET], tmp_path / "manager")
    compute = mount(one(docs, "Deployment", "compute"), "tls", roles["infinite-llm-tls-compute"], tmp_path / "compute")
    with rendered_etcd(docs, etcd_tls[ETCD_SECRET], tmp_path, n_members=3) as members:
        assert asyncio.run(put_get(members[0].ports["grpc"], as_manager, "replicated")) == b"manager"
        assert asyncio.run(put_get(members[2].ports["grpc"], as_manager, "replicated", value=None)) == b"manager"
        tls = members[1].root / "tls"
        peers = get(f"https://127.0.0.1:{members[1].ports['peer']}/members", tls_context(tls, "etcd", tls / "ca.pem"))
        assert sorted(m["name"] for m in peers) == ["etcd-0", "etcd-1", "etcd-2"]
        assert all(u.startswith("https://") for m in peers for u in m["peerURLs"])
        with pytest.raises(OSError):
            get(
                f"https://127.0.0.1:{members[1].ports['peer']}/members", tls_context(compute, "compute", tls / "ca.pem")
            )
        assert members[1].logged(REFUSED)
