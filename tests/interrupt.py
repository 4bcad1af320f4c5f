"""Ctrl-C for tests of real processes: :func:`reaped` kills a process a test leaves running, :func:`interrupt`
sends it SIGINT and times its exit."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed and waited for on the way out if it still runs (a failed assertion, a timeout)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def interrupt(proc: subprocess.Popen, timeout_s: float = 30.0) -> tuple[int, float]:
    """SIGINT to ``proc``; ``(its exit status, seconds from the signal to its exit)``. Raises
    ``subprocess.TimeoutExpired`` when it still runs after ``timeout_s`` seconds."""
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    returncode = proc.wait(timeout=timeout_s)
    return returncode, time.monotonic() - start
