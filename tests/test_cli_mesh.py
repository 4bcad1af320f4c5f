"""Flags of ``infinite-llm serve compute|router`` for the cluster view, and of ``serve manager`` for etcd's
mTLS: bad values exit 2 naming the flag, before any model is loaded or any service is called (a real
process, as a user runs it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "infinite_llm.cli"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["compute", "--home", ""], "home must be a non-empty string"),
        (["compute", "--home", "attn-0,attn 1"], "home may only hold the characters"),
        (["compute", "--node-name", "node/1"], "node-name may only hold the characters"),
        (["compute", "--instance-id", "a/b"], "instance_id may only hold the characters"),
        (["attention", "--node-name", "node 1"], "node-name may only hold the characters"),
        (["router"], "router needs --manager HOST:PORT (discovery) or --compute HOST:PORT"),
        (["router", "--manager", "127.0.0.1:1", "--discovery-interval", "0"], "discovery interval must be > 0 s"),
    ],
)
def test_bad_cluster_view_flags_exit_2_naming_the_problem(args, message):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("NODE_NAME", None)
    proc = subprocess.run([*CLI, "serve", *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    flat = " ".join(proc.stderr.replace("│", " ").split())  # rich boxes and wraps the message
    assert message in flat, proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--etcd", "https://127.0.0.1:1", "--etcd-tls-dir", "/nonexistent"],
            "--etcd-tls-dir /nonexistent: cannot read ca.pem",
        ),
        (
            ["--etcd", "127.0.0.1:1", "--etcd-tls-dir", "/tmp"],
            "--etcd-tls-dir needs an https://HOST:PORT --etcd endpoint",
        ),
        (["--etcd", "https://127.0.0.1:1"], "needs a certificate: give --etcd-tls-dir or --tls-dir"),
    ],
)
def test_bad_etcd_tls_flags_of_the_manager_exit_2_before_dialling(args, message):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("INFINITE_LLM_ETCD_TLS_DIR", None)
    cmd = [*CLI, "serve", "manager", "--insecure", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    flat = " ".join(proc.stderr.replace("│", " ").split())
    assert message in flat, proc.stderr


def test_tables_are_not_cut_to_80_columns_when_stdout_is_not_a_terminal(monkeypatch):
    from rich.table import Table

    from infinite_llm.cli_mesh import _stdout

    monkeypatch.delenv("COLUMNS", raising=False)  # pytest captures stdout: not a terminal
    table = Table()
    table.add_column("log")
    table.add_row("/tmp/infinite-llm-mesh-0qu2z9m3/" + "x" * 100 + ".log")
    console = _stdout()
    with console.capture() as captured:
        console.print(table)
    assert "x" * 100 + ".log" in captured.get()  # whole: a log path one can open
    monkeypatch.setenv("COLUMNS", "100")
    assert _stdout().width == 100  # COLUMNS still decides
