"""Ctrl-C on ``infinite-llm generate --router``, a real process streaming from the session mesh: the call is
cancelled at once, the router aborts the request and its rBlocks are freed, and the process says so in one
line on stderr and exits 130 (128 + SIGINT)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from tests.e2e.conftest import server_stats, wait_until
from tests.interrupt import interrupt, reaped

CLI = [sys.executable, "-m", "infinite_llm.cli"]
PROMPT = "Count from 1 to 500, one number per line:"  # the model writes numbers until max_tokens


def _used_blocks(mesh) -> int:  # noqa: ANN001
    return sum(server_stats(p.address).num_used for p in mesh.attention_servers() if p.alive())


def _read_into(pipe, out: bytearray) -> threading.Thread:  # noqa: ANN001
    def read() -> None:
        while chunk := pipe.read1(4096):
            out.extend(chunk)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_sigint_cancels_the_stream_at_once_frees_its_rblocks_and_exits_130(mesh):
    baseline = _used_blocks(mesh)
    argv = [*CLI, "generate", "--prompt", PROMPT, "--max-tokens", "300", "--router", mesh.router_address]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the session's TLS directory names the client's identity
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    stdout, stderr = bytearray(), bytearray()
    readers = [_read_into(proc.stdout, stdout), _read_into(proc.stderr, stderr)]
    with reaped(proc):
        assert wait_until(lambda: len(stdout) >= 8, timeout_s=120), bytes(stderr).decode()
        assert proc.poll() is None and _used_blocks(mesh) > baseline  # streaming, its KV on the servers
        returncode, took = interrupt(proc)
    for reader in readers:
        reader.join(10)
    assert returncode == 130, bytes(stderr).decode()
    assert took < 5.0, took
    lines = bytes(stderr).decode().strip().splitlines()
    assert lines == ["interrupted: the request was cancelled"]  # no traceback, no gRPC status text
    assert bytes(stdout).endswith(b"\n")  # the text so far, ended as a finished one is
    assert wait_until(lambda: _used_blocks(mesh) == baseline, timeout_s=10), _used_blocks(mesh)
