"""Children that die with their parent: ``subprocess.Popen(dying_with_parent(cmd), env=...)``.

``infinite-llm up`` starts etcd and every service as its children and stops them on a signal; when it is
killed outright (SIGKILL, the OOM killer) it cannot, and they would keep running and holding their ports.
On Linux the kernel sends a process ``PR_SET_PDEATHSIG``'s signal (SIGTERM: the services' graceful drain)
when its parent dies, and the setting survives ``exec``. :func:`dying_with_parent` prefixes a command with
``python -m infinite_llm.parent_death``, which sets it and then ``exec``s the command (a Python service or
etcd's binary alike), so the child keeps its pid and its parent. Elsewhere the command is returned as is.

Why not ``preexec_fn``: it runs Python between ``fork`` and ``exec``, with the parent's at-fork handlers, in
a child of a threaded parent; in CI a library's handler aborted a forked child there ("Fatal Python error:
Aborted" in ``filelock``'s ``ensure_current_process``), which is the hazard the ``subprocess`` docs warn of.

Caveat (prctl(2)): the signal follows the *thread* that forked the child, not the process, so a child
started from a short-lived thread would be stopped when that thread ends. Commands are therefore wrapped only
when started from the main thread (where ``up`` starts and restarts them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dying_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when this process dies: prefixed with this module (Linux, main
    thread), else ``cmd`` unchanged."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return cmd
    return [sys.executable, "-m", __name__, str(os.getpid()), *cmd]


def unwrapped(cmd: list[str]) -> list[str]:
    """``cmd`` without the prefix :func:`dying_with_parent` gave it (as is when it has none)."""
    return cmd[4:] if cmd[:3] == [sys.executable, "-m", __name__] else cmd


def _exec_dying_with_parent(parent: int, cmd: list[str]) -> None:
    """Set ``PR_SET_PDEATHSIG`` to SIGTERM, exit at once if ``parent`` is already gone, then exec ``cmd``."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"parent_death: prctl failed (errno {ctypes.get_errno()}); running without it", file=sys.stderr)
    elif os.getppid() != parent:  # the parent died before prctl: no signal will come
        sys.exit(f"parent_death: the parent process {parent} is gone; not starting {cmd[0]}")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m infinite_llm.parent_death PARENT_PID COMMAND [ARG ...]")
    _exec_dying_with_parent(int(sys.argv[1]), sys.argv[2:])
