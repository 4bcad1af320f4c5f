"""``infinite-llm up`` killed outright (SIGKILL: it cannot stop the mesh): every child it started, etcd
included, gets SIGTERM from the kernel (``parent_death``) and exits, freeing its port for the next ``up``, and
its run directory keeps only the logs (``run_dir_reaper``: no CA, key or etcd data is left behind). A real
process tree, the size of ``test_up_tls``."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from infinite_llm.mesh import port_in_use
from tests.e2e.test_up_tls import _wait_for_tls_dir, start_up


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from /proc; zombies count as gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _parent_and_state(int(entry.name))[0] == pid:
            found.append(int(entry.name))
    return [p for p in found if _alive(p)]


def _parent_and_state(pid: int) -> tuple[int, str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1, "gone"
    fields = stat.rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    return int(fields[1]), fields[0]


def _alive(pid: int) -> bool:
    return _parent_and_state(pid)[1] not in ("gone", "Z", "X")  # a reparented zombie has exited


def test_killing_up_stops_every_service_it_started(default_model_path, tmp_path):
    log = tmp_path / "up.out"
    proc, (router, manager, gateway) = start_up(log)
    children: list[int] = []
    run_dir = None
    try:
        run_dir = _wait_for_tls_dir(proc, log).parent
        assert "API key required" not in log.read_text()  # started without INFINITE_LLM_API_KEY
        children = _children(proc.pid)
        assert len(children) == 7, children  # etcd, the reaper, manager, attn-0, compute-0, router, gateway
        assert (run_dir / "tls").is_dir() and (run_dir / "etcd" / "etcd").is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while [p for p in children if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p for p in children if _alive(p)] == [], log.read_text()
        assert not any(port_in_use(p) for p in (router, manager, gateway))
        assert [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_dir()] == ["etcd"]  # logs only
        assert (run_dir / "manager-0.log").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if run_dir is not None:  # up, killed, could not remove it
            shutil.rmtree(run_dir, ignore_errors=True)
