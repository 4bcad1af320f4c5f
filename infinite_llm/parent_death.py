"""Children that die with their parent: ``subprocess.Popen(..., preexec_fn=die_with_parent())``.

``infinite-llm up`` starts etcd and every service as its children and stops them on a signal; when it is
killed outright (SIGKILL, the OOM killer) it cannot, and they would keep running and holding their ports.
On Linux the kernel sends a child ``PR_SET_PDEATHSIG``'s signal (SIGTERM: the services' graceful drain)
when its parent dies. Elsewhere nothing changes.

Caveat (prctl(2)): the signal follows the *thread* that forked the child, not the process, so a child
started from a short-lived thread would be stopped when that thread ends. :func:`die_with_parent` therefore
arms it only for children started from the main thread (where ``up`` starts and restarts them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (None where it cannot:
    not Linux, or not the main thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    # Loaded and looked up here: between fork and exec the child must not take a lock another thread of the
    # parent may have held (dlopen/dlsym's); the call itself and getppid/kill are plain system calls.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:  # runs in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), sig)

    return arm
