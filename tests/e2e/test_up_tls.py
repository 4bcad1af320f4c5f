"""``infinite-llm up`` as a user runs it: it makes a CA and per-role certificates in its run directory, every
service serves mTLS, and it prints the ``--tls-dir`` a client needs; with that, ``status`` and
``generate --router`` work, and without it a plaintext client is refused (a real process tree)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.state.etcd_launcher import free_port
from tests.e2e.conftest import BLOCKS_PER_SERVER, BYTES_PER_BLOCK

CLI = [sys.executable, "-m", "infinite_llm.cli"]


API_KEY = "up-test-key-7f3a"


def _env(api_key: str | None = None) -> dict[str, str]:
    """The environment of ``up`` and its clients: no TLS directory (up makes its own CA) and
    ``INFINITE_LLM_API_KEY`` only when ``api_key`` is given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}
    env.pop("INFINITE_LLM_TLS_DIR", None)
    env.pop("INFINITE_LLM_API_KEY", None)
    if api_key is not None:
        env["INFINITE_LLM_API_KEY"] = api_key
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


def start_up(log: Path, api_key: str | None = None) -> tuple[subprocess.Popen, tuple[int, int, int]]:
    """``infinite-llm up`` with one attention server (``INFINITE_LLM_API_KEY=api_key`` if given), its output in
    ``log``: the process and its router, manager and gateway ports."""
    router, manager, gateway = free_port(), free_port(), free_port()
    args = ["up", "--attention-servers", "1", "--kv-memory", str(BLOCKS_PER_SERVER * BYTES_PER_BLOCK)]
    args += ["--port", str(router), "--manager-port", str(manager), "--gateway-port", str(gateway)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=subprocess.STDOUT, env=_env(api_key))
    return proc, (router, manager, gateway)


def test_up_makes_a_ca_and_prints_the_tls_dir_clients_need(default_model_path, tmp_path):
    """Started with ``INFINITE_LLM_API_KEY`` set, ``up`` also says the mesh needs it (without printing it),
    and a client without it is refused by the router and the gateway."""
    log = tmp_path / "up.out"
    proc, (router, manager, gateway) = start_up(log, api_key=API_KEY)
    try:
        tls_dir = _wait_for_tls_dir(proc, log)
        banner = log.read_text(errors="replace")
        assert "API key required (INFINITE_LLM_API_KEY is set): the OpenAI API and the router take" in banner
        assert API_KEY not in banner
        assert {p.name for p in tls_dir.iterdir()} >= {"ca.pem", "client.pem", "client-key.pem"}
        assert (tls_dir / "client-key.pem").stat().st_mode & 0o077 == 0
        status = subprocess.run(
            [*CLI, "status", "--manager", f"127.0.0.1:{manager}", "--tls-dir", str(tls_dir)],
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
        assert status.returncode == 0 and "attn-0" in status.stdout, status.stderr
        # Inside a service's pod the TLS directory holds that role's files only: --tls-role presents them.
        manager_only = tmp_path / "manager-tls"
        manager_only.mkdir()
        for name in ("ca.pem", "manager.pem", "manager-key.pem"):
            (manager_only / name).write_bytes((tls_dir / name).read_bytes())
        as_manager = [*CLI, "status", "--manager", f"127.0.0.1:{manager}", "--tls-dir", str(manager_only)]
        status = subprocess.run(
            [*as_manager, "--tls-role", "manager"], capture_output=True, text=True, timeout=120, env=_env()
        )
        assert status.returncode == 0 and "attn-0" in status.stdout, status.stderr
        status = subprocess.run(as_manager, capture_output=True, text=True, timeout=120, env=_env())
        assert status.returncode == 2 and "client.pem" in status.stderr, status.stderr
        generate = subprocess.run(
            [*CLI, "generate", "--prompt", "The capital of France is", "--max-tokens", "4"]
            + ["--router", f"127.0.0.1:{router}", "--tls-dir", str(tls_dir)],
            capture_output=True, text=True, timeout=300, env=_env(API_KEY),
        )  # fmt: skip
        assert generate.returncode == 0 and generate.stdout.strip(), generate.stderr
        keyless = subprocess.run(
            [*CLI, "generate", "--prompt", "The capital of France is", "--max-tokens", "4"]
            + ["--router", f"127.0.0.1:{router}", "--tls-dir", str(tls_dir)],
            capture_output=True, text=True, timeout=300, env=_env(),
        )  # fmt: skip
        assert keyless.returncode == 1 and keyless.stderr.startswith("error:"), keyless.stderr
        assert keyless.stdout.strip() == ""
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway}", trust_env=False, timeout=30) as http:
            assert http.get("/v1/models").status_code == 401
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
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
        # etcd killed under the mesh: up starts it again on its port with its data, and status works again.
        # Stopped after a crash, up keeps the run directory's logs (not its keys nor etcd's data) and says so.
        run_dir = tls_dir.parent
        os.kill(_pid_running(f"--data-dir={run_dir / 'etcd' / 'etcd'}"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "etcd exited; restarted" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text(errors="replace")
            time.sleep(0.5)
        status = subprocess.run(
            [*CLI, "status", "--manager", f"127.0.0.1:{manager}", "--tls-dir", str(tls_dir)],
            capture_output=True, text=True, timeout=120, env=_env(),
        )  # fmt: skip
        assert status.returncode == 0 and "attn-0" in status.stdout, status.stderr
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        assert f"the services' logs are kept in {run_dir}" in " ".join(log.read_text(errors="replace").split())
        assert not (run_dir / "tls").exists() and not (run_dir / "etcd" / "etcd").exists()
        assert (run_dir / "etcd" / "etcd.log").is_file() and (run_dir / "manager-0.log").is_file()
        shutil.rmtree(run_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _pid_running(argument: str) -> int:
    """The process whose command line holds ``argument`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue
    raise AssertionError(f"no process runs with {argument}")
