"""``infinite_llm.parent_death``: the command it wraps runs with ``PR_SET_PDEATHSIG`` = SIGTERM, under its own
pid and parent (exec, no extra process), and does not start when the parent it names is gone (real
processes; Linux only, as the module)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from infinite_llm.parent_death import dying_with_parent, unwrapped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

REPORT = """
import ctypes, os
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(os.getpid(), os.getppid(), sig.value)
"""


def test_the_wrapped_command_runs_with_sigterm_as_its_parent_death_signal():
    cmd = [sys.executable, "-c", REPORT]
    wrapped = dying_with_parent(cmd)
    assert wrapped[-len(cmd) :] == cmd and unwrapped(wrapped) == cmd and unwrapped(cmd) == cmd
    proc = subprocess.Popen(wrapped, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.split() == [str(proc.pid), str(os.getpid()), str(int(signal.SIGTERM))]  # exec'd: same pid


def test_an_unwrapped_command_has_no_parent_death_signal():
    out = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=60).stdout
    assert out.split()[2] == "0"


def test_a_command_whose_parent_is_already_gone_does_not_start(tmp_path):
    marker = tmp_path / "started"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that is not this test's parent of the child
    cmd = [sys.executable, "-m", "infinite_llm.parent_death", str(gone.pid), "touch", str(marker)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"the parent process {gone.pid} is gone" in proc.stderr
    assert not marker.exists()
