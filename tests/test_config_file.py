"""Options come from flags, then INFINITE_LLM_* variables, then the YAML file, then defaults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer

from infinite_llm.cli import app
from infinite_llm.config_file import load_config


def _status(tmp_path, yaml_text: str | None, env: dict[str, str], *flags: str) -> str:
    """Run ``infinite-llm status`` against closed ports; the error names the manager address it used.
    Plaintext (``INFINITE_LLM_INSECURE``): the option sources are under test, not certificates."""
    env = {"INFINITE_LLM_INSECURE": "1", **env}
    args = [sys.executable, "-m", "infinite_llm.cli"]
    if yaml_text is not None:
        path = tmp_path / "c.yaml"
        path.write_text(yaml_text)
        args += ["--config", str(path)]
    proc = subprocess.run(
        [*args, "status", *flags], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )
    assert proc.returncode == 1, proc.stderr  # the manager is unreachable: a service-side failure
    return proc.stderr


def test_flag_beats_environment_beats_yaml(tmp_path):
    yaml_text = "status:\n  manager: 127.0.0.1:1\n"
    assert "127.0.0.1:1:" in _status(tmp_path, yaml_text, {})
    env = {"INFINITE_LLM_STATUS_MANAGER": "127.0.0.1:2"}
    assert "127.0.0.1:2:" in _status(tmp_path, yaml_text, env)
    assert "127.0.0.1:3:" in _status(tmp_path, yaml_text, env, "--manager", "127.0.0.1:3")


def _root_command():
    return typer.main.get_command(app)


def test_yaml_mirrors_the_command_tree(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  attention:\n    kv-memory: 2GiB\n    port: 50061\nup:\n  attention_servers: 4\n")
    assert load_config(path, _root_command()) == {
        "serve": {"attention": {"kv_memory": "2GiB", "port": 50061}},
        "up": {"attention_servers": 4},
    }


@pytest.mark.parametrize(
    "text,message",
    [
        ("serve:\n  attention:\n    kv_memroy: 1GiB\n", "unknown option 'serve.attention.kv_memroy'"),
        ("serve:\n  atention: {}\n", "unknown command 'serve.atention'"),
        ("- just\n- a list\n", "must hold a mapping"),
        ("serve: [1, 2\n", "not valid YAML"),
    ],
)
def test_bad_config_files_are_named_errors(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(typer.BadParameter, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(path, _root_command())
