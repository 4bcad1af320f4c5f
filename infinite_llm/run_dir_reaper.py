"""What a run directory keeps when the launcher of a local mesh is killed outright (SIGKILL, the OOM killer).

A :class:`~infinite_llm.mesh.LocalMesh` removes its run directory when it stops, or keeps only the logs when
something failed (``keep_logs``). Killed outright, it can do neither: its children stop (``parent_death``),
but the directory would keep the CAs and keys the mesh made (anyone reading them could pose as any of its
services) and etcd's data (~60 MB). So the mesh starts this process beside etcd, holding the write end of its
stdin: ``python -m infinite_llm.run_dir_reaper DIR GRACE_S ETCD_PID``. It reads until that end closes. A mesh
that stopped on purpose writes :data:`STOPPED` first, and the reaper leaves. Otherwise the launcher died: the
reaper waits until etcd has exited (at most ``GRACE_S`` seconds: it got SIGTERM from the kernel), then
removes what a kept directory must not hold (:data:`MADE`) and leaves the logs, as a failed mesh does.

Standard library only, in its own session (a signal to the launcher's process group does not reach it).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

STOPPED = b"stopped\n"
# Made by a LocalMesh inside its run directory: its CAs and keys (a --tls-dir of the user's is elsewhere)
# and etcd's data directory. The services' logs and etcd's log stay.
MADE = ("tls", "etcd-tls", "etcd/etcd")


def drop_made(directory: Path) -> None:
    """Remove :data:`MADE` from a run directory (what is absent is skipped): what a kept run directory must
    not hold, the CAs and keys the mesh made (anyone who reads them could pose as any service of a later mesh
    using them, or sign more) and etcd's data (~60 MB, mostly its preallocated log)."""
    for made in MADE:
        shutil.rmtree(directory / made, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    directory, grace_s, etcd_pid = Path(argv[1]), float(argv[2]), int(argv[3])
    said = sys.stdin.buffer.read()  # until the launcher closes its end: after STOPPED, or by dying
    if said == STOPPED:
        return 0
    deadline = time.monotonic() + grace_s
    while _alive(etcd_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    drop_made(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
