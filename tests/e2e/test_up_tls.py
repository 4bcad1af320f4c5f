"""``infinite-llm up`` as a user runs it: it makes a CA and per-role certificates in its run directory, every
service serves mTLS, and it prints the ``--tls-dir`` a client needs; with that, ``status`` and
``generate --router`` work, and without it a plaintext client is refused (a real process tree)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.state.etcd_launcher import free_port
from tests.e2e.conftest import BLOCKS_PER_SERVER, BYTES_PER_BLOCK

CLI = [sys.executable, "-m", "infinite_llm.cli"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}
    env.pop("INFINITE_LLM_TLS_DIR", None)  # up makes its own CA
    return env


def _wait_for_tls_dir(proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"clients: --tls-dir (\S+)", log.read_text(errors="replace"))
        if found:
            return Path(found.group(1))
        assert proc.poll() is None, log.read_text()
        time.sleep(0.5)
    raise AssertionError(f"up printed no --tls-dir:\n{log.read_text()}")


def start_up(log: Path) -> tuple[subprocess.Popen, tuple[int, int, int]]:
    """``infinite-llm up`` with one attention server, its output in ``log``: the process and its router,
    manager and gateway ports."""
    router, manager, gateway = free_port(), free_port(), free_port()
    args = ["up", "--attention-servers", "1", "--kv-memory", str(BLOCKS_PER_SERVER * BYTES_PER_BLOCK)]
    args += ["--port", str(router), "--manager-port", str(manager), "--gateway-port", str(gateway)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=subprocess.STDOUT, env=_env())
    return proc, (router, manager, gateway)


def test_up_makes_a_ca_and_prints_the_tls_dir_clients_need(default_model_path, tmp_path):
    log = tmp_path / "up.out"
    proc, (router, manager, _) = start_up(log)
    try:
        tls_dir = _wait_for_tls_dir(proc, log)
        assert {p.name for p in tls_dir.iterdir()} >= {"ca.pem", "client.pem", "client-key.pem"}
        assert (tls_dir / "client-key.pem").stat().st_mode & 0o077 == 0
        status = subprocess.run(
            [*CLI, "status", "--manager", f"127.0.0.1:{manager}", "--tls-dir", str(tls_dir)],
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
        assert status.returncode == 0 and "attn-0" in status.stdout, status.stderr
        generate = subprocess.run(
            [*CLI, "generate", "--prompt", "The capital of France is", "--max-tokens", "4"]
            + ["--router", f"127.0.0.1:{router}", "--tls-dir", str(tls_dir)],
            capture_output=True, text=True, timeout=300, env=_env(),
        )  # fmt: skip
        assert generate.returncode == 0 and generate.stdout.strip(), generate.stderr
        no_tls = subprocess.run(
            [*CLI, "status", "--manager", f"127.0.0.1:{manager}"],
            capture_output=True,
            text=True,
            timeout=120,
            env=_env(),
        )
        assert no_tls.returncode == 2 and "mTLS is on by default" in " ".join(no_tls.stderr.replace("│", " ").split())
        for port in (router, manager):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    raise AssertionError(f"port {port} answered plaintext")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
        run_dir_logs = (tls_dir.parent / "manager-0.log").read_text()
        assert "mTLS as manager" in run_dir_logs
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
