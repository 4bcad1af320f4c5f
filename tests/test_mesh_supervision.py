"""``infinite-llm up``'s supervision (LocalMesh.restart_crashed): crashed managers, compute instances, routers
and gateways are started again with the same command line; attention servers stay down; a crash loop stops
it. Real processes (``sleep`` stands in for a service: only the process lifecycle is under test)."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.mesh import LocalMesh, MeshConfig, Proc, _bare
from infinite_llm.state.etcd_launcher import start_etcd

NICE = 10


def _proc(mesh: LocalMesh, role: str, name: str) -> Proc:
    log_path = mesh.log_dir / f"{name}.log"
    log_path.touch()
    popen = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)
    proc = Proc(role, name, "127.0.0.1:1", popen, log_path)
    mesh.procs.append(proc)
    return proc


@pytest.fixture
def mesh():
    m = LocalMesh(MeshConfig(insecure=True, service_nice=NICE))
    yield m
    for p in m.procs:
        p.popen.kill()
        p.popen.wait()
    shutil.rmtree(m.log_dir, ignore_errors=True)


def test_crashed_services_but_attention_servers_are_started_again_with_their_command(mesh):
    procs = {role: _proc(mesh, role, role) for role in ("manager", "compute", "router", "gateway", "attention")}
    assert mesh.restart_crashed() == []
    for p in procs.values():
        p.popen.kill()
        p.popen.wait()
    old_pids = {role: p.popen.pid for role, p in procs.items()}
    restarted = mesh.restart_crashed()
    assert sorted(p.name for p in restarted) == ["compute", "gateway", "manager", "router"]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for p in restarted:
        assert p.alive() and p.popen.pid != old_pids[p.role] and _bare(p.popen.args) == ["sleep", "60"]
        # compute instances keep this process's CPU niceness; every other service runs service_nice above it
        want = ours if p.role == "compute" else min(ours + NICE, 19)
        assert _niceness_once_running(p.popen.pid, "sleep") == want, p.role
    assert not procs["attention"].alive()


def _niceness_once_running(pid: int, comm: str) -> int:
    """The niceness of ``pid`` once it has exec'd ``comm`` (the launch wrappers exec it in turn)."""
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/comm").read().strip() != comm:
        assert time.monotonic() < deadline, f"{pid} never ran {comm}"
        time.sleep(0.01)
    return os.getpriority(os.PRIO_PROCESS, pid)


def test_a_crash_loop_stops_the_supervision(mesh):
    manager = _proc(mesh, "manager", "manager-0")
    for _ in range(2):
        manager.popen.kill()
        manager.popen.wait()
        assert mesh.restart_crashed(max_restarts=2) == [manager]
    manager.popen.kill()
    manager.popen.wait()
    with pytest.raises(Unavailable, match="manager-0 exited 3 times within 120 s"):
        mesh.restart_crashed(max_restarts=2)


def test_exits_spread_wider_than_the_crash_loop_window_are_restarted(mesh):
    """A manager killed now and then (failover drills) is no crash loop: only exits within the window count."""
    manager = _proc(mesh, "manager", "manager-0")
    for _ in range(3):
        manager.popen.kill()
        manager.popen.wait()
        assert mesh.restart_crashed(max_restarts=1, window_s=0.2) == [manager]
        time.sleep(0.3)


def _etcd_http(etcd, path: str, body: dict) -> dict:
    """One call of etcd's v3 JSON gateway (plaintext etcd)."""
    request = urllib.request.Request(f"{etcd.endpoint}/v3/kv/{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def test_a_crashed_etcd_is_started_again_on_its_port_with_its_data(mesh):
    """etcd killed under a running mesh: ``up`` used to leave it a zombie while every request failed. It
    comes back on the same port with the same data (the services ride the outage out:
    ``tests/e2e/test_mesh_orphans.py``), and counts toward the crash-loop limit like any service."""
    mesh.etcd = start_etcd(data_dir=mesh.log_dir / "etcd")
    mesh._start_reaper(mesh.etcd.process.pid)
    key = base64.b64encode(b"/infinite-llm/ledger/x").decode()
    _etcd_http(mesh.etcd, "put", {"key": key, "value": base64.b64encode(b"kept").decode()})
    assert mesh.restart_crashed() == []
    old, old_reaper = mesh.etcd, mesh._reaper
    old.process.kill()
    old.process.wait()  # SIGKILL is delivered, not yet done: as up's supervision, which polls every second
    (restarted,) = mesh.restart_crashed(max_restarts=1)
    try:
        # the run directory's reaper now waits for the new etcd (up killed outright: it would otherwise remove
        # etcd's data while the new etcd still runs); the old one left without touching anything
        assert old_reaper.wait(timeout=10) == 0 and mesh._reaper is not old_reaper
        assert mesh._reaper.args[-1] == str(mesh.etcd.process.pid) and mesh._reaper.poll() is None
        assert (restarted.role, restarted.name, restarted.address) == ("etcd", "etcd", f"127.0.0.1:{old.client_port}")
        assert restarted.alive() and restarted.popen is mesh.etcd.process and old.process.poll() is not None
        assert mesh.etcd.client_port == old.client_port and mesh.etcd.data_dir == old.data_dir
        (kv,) = _etcd_http(mesh.etcd, "range", {"key": key})["kvs"]
        assert base64.b64decode(kv["value"]) == b"kept"
        mesh.etcd.process.kill()
        mesh.etcd.process.wait()
        with pytest.raises(Unavailable, match="etcd exited 2 times"):
            mesh.restart_crashed(max_restarts=1)
    finally:
        mesh.etcd.stop()
        mesh._stop_reaper()


def test_a_failed_mesh_keeps_its_logs_but_not_its_keys_nor_etcds_data(monkeypatch):
    """``keep_logs`` (a failed start, a crash loop) keeps what explains the failure, not the CAs and private
    keys the mesh made nor etcd's ~60 MB of data."""
    monkeypatch.delenv("INFINITE_LLM_TLS_DIR", raising=False)
    mesh = LocalMesh(MeshConfig())
    mesh._setup_tls()
    assert (mesh.log_dir / "tls" / "manager-key.pem").exists() and (mesh.log_dir / "etcd-tls" / "etcd-key.pem").exists()
    assert not (mesh.log_dir / "tls" / "ca-key.pem").exists()  # up signs nothing later: its CA key is not kept
    (mesh.log_dir / "etcd" / "etcd" / "member").mkdir(parents=True)
    (mesh.log_dir / "etcd" / "etcd" / "member" / "wal").write_bytes(b"\0" * 1024)
    (mesh.log_dir / "etcd" / "etcd.log").write_text("etcd says")
    (mesh.log_dir / "gateway.log").write_text("address already in use")
    mesh.keep_logs = True
    try:
        mesh.stop()
        kept = sorted(str(p.relative_to(mesh.log_dir)) for p in mesh.log_dir.rglob("*"))
        assert kept == ["etcd", "etcd/etcd.log", "gateway.log"]
    finally:
        shutil.rmtree(mesh.log_dir, ignore_errors=True)


def test_a_mesh_that_stops_normally_removes_its_run_directory(monkeypatch):
    monkeypatch.delenv("INFINITE_LLM_TLS_DIR", raising=False)
    mesh = LocalMesh(MeshConfig())
    mesh._setup_tls()
    mesh.stop()
    assert not mesh.log_dir.exists()


def _bound_elsewhere(mesh: LocalMesh, role: str, name: str, args: list[str], log: str, exits: bool) -> Proc:
    """A stand-in service started with ``args`` whose log reads ``log``; it has exited when ``exits``."""
    log_path = mesh.log_dir / f"{name}.log"
    log_path.write_text(log)
    popen = subprocess.Popen(["sh", "-c", "exit 1" if exits else "sleep 60", "sh", *args])
    if exits:
        popen.wait()
    port = args[args.index("--port") + 1]
    proc = Proc(role, name, f"127.0.0.1:{port}", popen, log_path, f"127.0.0.1:{port}")
    mesh.procs.append(proc)
    return proc


def _arg(proc: Proc, flag: str) -> str:
    args = list(proc.popen.args)
    return args[args.index(flag) + 1]


GRPC_BIND = "infinite_llm.core.errors.Unavailable: cannot bind 127.0.0.1:{}: [Errno 98] Address already in use\n"


def test_a_router_whose_port_was_taken_moves_and_takes_its_gateway_along(mesh):
    router = _bound_elsewhere(mesh, "router", "router", ["--port", "40001", "--metrics-port", "40002"],
                              GRPC_BIND.format(40001), exits=True)  # fmt: skip
    gateway = _bound_elsewhere(mesh, "gateway", "gateway", ["--port", "40003", "--router", "127.0.0.1:40001"],
                               "", exits=False)  # fmt: skip
    other = _bound_elsewhere(mesh, "gateway", "gateway-b", ["--port", "40004", "--router", "127.0.0.1:49999"],
                             "", exits=False)  # fmt: skip
    gateway_pid, other_pid = gateway.popen.pid, other.popen.pid
    assert mesh._rebind(router)
    port = _arg(router, "--port")
    assert port != "40001" and router.address == f"127.0.0.1:{port}"
    assert router.metrics_address == f"127.0.0.1:{_arg(router, '--metrics-port')}" != "127.0.0.1:40002"
    assert gateway.popen.pid != gateway_pid and _arg(gateway, "--router") == router.address
    assert gateway.address == "127.0.0.1:40003" and _arg(gateway, "--port") == "40003"
    assert other.popen.pid == other_pid and _arg(other, "--router") == "127.0.0.1:49999"


def test_a_gateway_whose_port_was_taken_moves_with_its_metrics(mesh):
    uvicorn = (
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 40005): address already in use\n"
    )
    gateway = _bound_elsewhere(mesh, "gateway", "gateway", ["--port", "40005", "--router", "127.0.0.1:40001"],
                               uvicorn, exits=True)  # fmt: skip
    assert mesh._rebind(gateway)
    assert gateway.address == f"127.0.0.1:{_arg(gateway, '--port')}" == gateway.metrics_address != "127.0.0.1:40005"
    assert _arg(gateway, "--router") == "127.0.0.1:40001"


def test_a_port_the_caller_chose_the_manager_and_other_exits_are_not_moved(mesh):
    fixed = _bound_elsewhere(mesh, "router", "router", ["--port", "40006", "--metrics-port", "40007"],
                             GRPC_BIND.format(40006), exits=True)  # fmt: skip
    fixed.fixed_port = True
    manager = _bound_elsewhere(mesh, "manager", "manager-0", ["--port", "40008", "--metrics-port", "40009"],
                               GRPC_BIND.format(40008), exits=True)  # fmt: skip
    crashed = _bound_elsewhere(mesh, "compute", "compute-0", ["--port", "40010", "--metrics-port", "40011"],
                               "RuntimeError: out of memory\n", exits=True)  # fmt: skip
    for proc in (fixed, manager, crashed):
        pid = proc.popen.pid
        assert not mesh._rebind(proc)
        assert proc.popen.pid == pid


def test_the_meshs_dtype_and_device_reach_its_attention_servers_and_compute_instances(monkeypatch):
    """`up --dtype/--device` (MeshConfig.dtype/device): both flags on every attention server's and compute
    instance's command line, none on the others'; unset, none anywhere (each service's own default)."""
    import infinite_llm.mesh as mesh_module

    started: list[list[str]] = []

    def fake_popen(cmd, log_path, role, nice=0, append=False):  # noqa: ANN001, ANN202
        started.append(list(cmd))
        return subprocess.Popen(["true"])

    monkeypatch.setattr(mesh_module, "_popen", fake_popen)
    for dtype, device in (("bfloat16", "cuda:1"), (None, None)):
        started.clear()
        m = LocalMesh(MeshConfig(insecure=True, dtype=dtype, device=device))
        m.procs.append(Proc("manager", "manager-0", "127.0.0.1:1", subprocess.Popen(["true"]), m.log_dir / "m.log"))
        m.spawn_attention("attn-0")
        m.spawn_compute("compute-0")
        m.spawn_router("router")
        shutil.rmtree(m.log_dir, ignore_errors=True)
        want = ["--dtype", dtype, "--device", device] if dtype else []
        for cmd in started[:2]:
            flags = [
                a for i, a in enumerate(cmd) if a in ("--dtype", "--device") or cmd[i - 1] in ("--dtype", "--device")
            ]
            assert flags == want, cmd
        assert "--dtype" not in started[2] and "--device" not in started[2]


def test_a_config_file_reaches_every_service_and_an_option_the_mesh_sets_is_refused(monkeypatch, tmp_path):
    """`infinite-llm --config F up`: every service gets `--config F` (its `serve: <role>:` section applies);
    a section option the mesh passes as a flag (here `device`, from `up --device`) would be beaten silently,
    so the service is not started and the error names the key."""
    import infinite_llm.mesh as mesh_module
    from infinite_llm.core.errors import InvalidRequest

    started: list[list[str]] = []

    def fake_popen(cmd, log_path, role, nice=0, append=False):  # noqa: ANN001, ANN202
        started.append(list(cmd))
        return subprocess.Popen(["true"])

    monkeypatch.setattr(mesh_module, "_popen", fake_popen)
    path = str(tmp_path / "c.yaml")
    m = LocalMesh(
        MeshConfig(insecure=True, device="cpu", config_file=path, file_options={"compute": ("drain_timeout",)})
    )
    m.procs.append(Proc("manager", "manager-0", "127.0.0.1:1", subprocess.Popen(["true"]), m.log_dir / "m.log"))
    m.spawn_compute("compute-0")
    (cmd,) = started
    assert cmd[cmd.index("--config") + 1] == path and cmd.index("--config") < cmd.index("serve")
    assert "--max-waiting" in cmd  # the mesh's default, as the file does not set it
    m.config = dataclasses.replace(m.config, file_options={"compute": ("max_num_seqs", "max_waiting")})
    m.spawn_compute("compute-2")  # the mesh's own defaults, with no `up` option: the file's values replace them
    assert "--max-num-seqs" not in started[1] and "--max-waiting" not in started[1]
    assert "--max-num-batched-tokens" in started[1] and "--config" in started[1]
    started.pop()
    m.config = dataclasses.replace(m.config, file_options={"compute": ("device", "drain_timeout", "prefix_caching")})
    beaten = r"sets serve\.compute\.device, serve\.compute\.prefix_caching itself on every compute it starts"
    with pytest.raises(InvalidRequest, match=beaten):
        m.spawn_compute("compute-1")
    assert len(started) == 1  # nothing started
    shutil.rmtree(m.log_dir, ignore_errors=True)


def test_every_roles_beaten_config_file_options_are_named_in_one_error_before_anything_starts(monkeypatch, tmp_path):
    """A file that sets options `up` passes itself in several roles' sections is refused in one error naming
    them all, before etcd or any service starts (role by role, each would take a start and a failure)."""
    import infinite_llm.mesh as mesh_module
    from infinite_llm.core.errors import InvalidRequest

    def no_etcd(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("etcd started")

    def no_popen(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a service started")

    monkeypatch.setattr(mesh_module, "start_etcd", no_etcd)
    monkeypatch.setattr(mesh_module, "_popen", no_popen)
    options = {
        "manager": ("block_size", "leader_ttl"),  # leader_ttl: `up` does not pass it
        "attention": ("kv_memory", "drain_timeout"),
        "compute": ("device", "max_num_seqs"),  # max_num_seqs: a mesh default the file may replace
        "gateway": ("router",),
        "router": ("discovery_interval",),  # a mesh default too
    }
    m = LocalMesh(MeshConfig(insecure=True, device="cpu", config_file=str(tmp_path / "c.yaml"), file_options=options))
    with pytest.raises(InvalidRequest) as e:
        m.start()
    assert e.value.message.startswith(
        f"config file {tmp_path / 'c.yaml'}: `up` sets serve.manager.block_size, serve.attention.kv_memory, "
        "serve.compute.device, serve.gateway.router itself on every manager, attention, compute and gateway it "
        "starts, so the file's value would be ignored"
    ), e.value.message
    assert m.procs == [] and m.etcd is None


def test_up_hands_its_config_file_and_the_files_serve_options_to_the_mesh(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import infinite_llm.mesh as mesh_module
    from infinite_llm.cli import app

    seen = {}

    class Stop(Exception):
        pass

    class FakeMesh:
        def __init__(self, config: MeshConfig) -> None:
            seen["config"] = config
            raise Stop

    monkeypatch.setattr(mesh_module, "LocalMesh", FakeMesh)
    (tmp_path / "c.yaml").write_text("serve:\n  compute:\n    max-waiting: 7\n  attention:\n    kv_memory: 1MiB\n")
    monkeypatch.chdir(tmp_path)
    flags = ["--insecure", "--port", "0", "--gateway-port", "0", "--manager-port", "0"]
    result = CliRunner().invoke(app, ["--config", "c.yaml", "up", *flags])
    assert isinstance(result.exception, Stop), result.output
    config = seen["config"]
    assert config.config_file == str(tmp_path / "c.yaml")  # absolute: the services start in another directory
    assert config.file_options == {"compute": ("max_waiting",), "attention": ("kv_memory",)}
