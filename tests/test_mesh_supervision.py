"""``infinite-llm up``'s supervision (LocalMesh.restart_crashed): crashed managers, compute instances, routers
and gateways are started again with the same command line; attention servers stay down; a crash loop stops
it. Real processes (``sleep`` stands in for a service: only the process lifecycle is under test)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.mesh import LocalMesh, MeshConfig, Proc


def _proc(mesh: LocalMesh, role: str, name: str) -> Proc:
    log_path = mesh.log_dir / f"{name}.log"
    log_path.touch()
    popen = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)
    proc = Proc(role, name, "127.0.0.1:1", popen, log_path)
    mesh.procs.append(proc)
    return proc


@pytest.fixture
def mesh():
    m = LocalMesh(MeshConfig(insecure=True))
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
    for p in restarted:
        assert p.alive() and p.popen.pid != old_pids[p.role] and p.popen.args == ["sleep", "60"]
    assert not procs["attention"].alive()


def test_a_crash_loop_stops_the_supervision(mesh):
    manager = _proc(mesh, "manager", "manager-0")
    for _ in range(2):
        manager.popen.kill()
        manager.popen.wait()
        assert mesh.restart_crashed(max_restarts=2) == [manager]
    manager.popen.kill()
    manager.popen.wait()
    with pytest.raises(Unavailable, match="manager-0 exited 3 times"):
        mesh.restart_crashed(max_restarts=2)
