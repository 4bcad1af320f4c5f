"""``run_dir_reaper``: when the process that launched a local mesh is killed outright, the run directory
loses the CAs, keys and etcd data the mesh made and keeps its logs; when the mesh stops on purpose, the reaper
leaves without touching anything. Real processes: a launcher that starts the reaper as ``LocalMesh`` does,
then is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infinite_llm.run_dir_reaper import MADE, STOPPED

LAUNCHER = f"""
import subprocess, sys, time
reaper = subprocess.Popen(
    [sys.executable, "-m", "infinite_llm.run_dir_reaper", sys.argv[1], "30", sys.argv[2]],
    stdin=subprocess.PIPE, start_new_session=True,
)
print(reaper.pid, flush=True)
if sys.argv[3] == "stop":
    reaper.stdin.write({STOPPED!r})
    reaper.stdin.close()
    reaper.wait()
else:
    time.sleep(600)
"""


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "infinite-llm-mesh-x"
    for made in MADE:
        (run / made).mkdir(parents=True)
        (run / made / "secret").write_text("key")
    (run / "manager-0.log").write_text("log")
    (run / "etcd" / "etcd.log").write_text("etcd log")
    return run


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_launcher_killed_outright_leaves_only_the_logs(tmp_path):
    run = _run_dir(tmp_path)
    etcd = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # stands in for etcd
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(run), str(etcd.pid), "die"], stdout=subprocess.PIPE, text=True
    )
    try:
        reaper = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        time.sleep(0.5)
        assert all((run / made).exists() for made in MADE)  # it waits for etcd first (which writes there)
        etcd.kill()
        etcd.wait()
        assert _gone(reaper, 10), "the reaper did not finish"
    finally:
        etcd.kill()
        launcher.kill()
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == ["etcd", "etcd/etcd.log", "manager-0.log"]


def test_a_mesh_that_stopped_on_purpose_is_left_alone(tmp_path):
    run = _run_dir(tmp_path)
    before = sorted(run.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(run), str(os.getpid()), "stop"], capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert _gone(int(proc.stdout.split()[0]), 10)
    assert sorted(run.rglob("*")) == before
