"""``infinite-llm generate`` as a user runs it: a real process, only the text on stdout, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinite_llm.core.sampling import SamplingParams
from tests.interrupt import interrupt, reaped

CLI = [sys.executable, "-m", "infinite_llm.cli"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(num_kv_blocks=256)


def test_generate_prints_only_the_greedy_text(engine):
    proc = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    ref = engine.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert proc.stdout == ref.text + "\n"
    assert "tokens/s" in proc.stderr


def test_chat_prompt_from_stdin_uses_the_chat_template(engine, tmp_path: Path):
    question = "What is 2 + 2?"
    proc = run_cli("generate", "--chat", "--prompt-file", "-", "--max-tokens", "10", stdin=question)
    assert proc.returncode == 0, proc.stderr
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    ids = engine.tokenizer.encode(chat, add_special_tokens=False)
    ref = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    assert proc.stdout == ref.text + "\n"
    f = tmp_path / "q.txt"
    f.write_text(question)
    assert run_cli("generate", "--chat", "--prompt-file", str(f), "--max-tokens", "10").stdout == proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be a positive integer"),
        (["--prompt", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "9000"], "exceeds the model's maximum length"),
        (["--prompt-file", "/nonexistent/file.txt"], "does not exist"),
        (["--prompt-file", sys.executable], "is not UTF-8 text ("),
        (["--prompt", "hi", "--model", "/nonexistent/model"], "does not exist"),
        (["--prompt", "hi", "--block-size", "0"], "block_size must be >= 1, got 0"),
        (["--prompt", "hi", "--num-partitions", "0"], "Invalid value for '--num-partitions'"),
        (["--prompt", "hi", "--device", "tpu"], "unknown device 'tpu'; use cpu, cuda or cuda:N"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message):
    proc = run_cli("generate", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    flat = " ".join(proc.stderr.replace("│", " ").split())  # rich may box and wrap the message
    assert message in flat, proc.stderr
    assert proc.stdout == ""


def test_sigint_while_generating_locally_stops_at_once_and_exits_130():
    """The single-process engine: Ctrl-C aborts the request, one line on stderr, exit 130 (128 + SIGINT). The
    mesh's case, where the call is cancelled and the rBlocks freed: ``tests/e2e/test_cli_interrupt.py``."""
    argv = [*CLI, "generate", "--prompt", "Count from 1 to 500:", "--max-tokens", "500"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    with reaped(proc):
        first = proc.stdout.read1(4096)  # the first text: the model is loaded and generating
        assert first and proc.poll() is None
        returncode, took = interrupt(proc)
    stderr = proc.stderr.read().decode()
    assert returncode == 130 and took < 5.0, (returncode, took, stderr)
    assert stderr.strip().splitlines()[-1] == "interrupted: the request was cancelled"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_an_unreachable_router_is_a_service_failure_exit_1(tmp_path):
    from infinite_llm.rpc.certs import write_tls_dir

    tls_dir = str(write_tls_dir(tmp_path))
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--max-tokens", "2", "--tls-dir", tls_dir)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error:"), proc.stderr  # one line
    assert proc.stdout == ""


def test_dialing_a_router_needs_tls_or_an_explicit_insecure(tmp_path, monkeypatch):
    """mTLS is on by default: no --tls-dir is a usage error (exit 2) before anything is dialled; --insecure
    says loudly that it is off."""
    monkeypatch.delenv("INFINITE_LLM_TLS_DIR", raising=False)
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--max-tokens", "2")
    assert proc.returncode == 2, proc.stderr
    flat = " ".join(proc.stderr.replace("│", " ").split())
    assert "mTLS is on by default: give --tls-dir DIR (or INFINITE_LLM_TLS_DIR)" in flat, proc.stderr
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--max-tokens", "2", "--insecure")
    assert proc.returncode == 1, proc.stderr
    assert "--insecure: mTLS is OFF" in proc.stderr
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--tls-dir", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "cannot read ca.pem" in " ".join(proc.stderr.replace("│", " ").split())


@pytest.mark.parametrize(
    "args,given",
    [
        (["--block-size", "0"], "--block-size: configures the in-process engine and does not apply with --router"),
        (["--kv-blocks", "1"], "--kv-blocks: configures the in-process engine and does not apply with --router"),
        (
            ["--device", "cpu", "--no-prefix-caching"],
            "--device, --prefix-caching/--no-prefix-caching: configure the in-process engine and do not apply",
        ),
    ],
)
def test_engine_flags_with_router_exit_2_before_dialling(args, given, monkeypatch):
    """They would be ignored by the mesh: a usage error, before TLS is even looked at (no --tls-dir here)."""
    monkeypatch.delenv("INFINITE_LLM_TLS_DIR", raising=False)
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", *args)
    assert proc.returncode == 2, proc.stderr
    flat = " ".join(proc.stderr.replace("│", " ").split())
    assert f"Invalid value for {given}" in flat, proc.stderr
    assert "mTLS" not in flat and proc.stdout == ""


def test_an_engine_flag_from_its_environment_variable_is_refused_with_router(monkeypatch):
    monkeypatch.setenv("INFINITE_LLM_GENERATE_KV_BLOCKS", "1")
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--insecure")
    assert proc.returncode == 2, proc.stderr
    assert "Invalid value for --kv-blocks" in " ".join(proc.stderr.replace("│", " ").split())


def test_a_missing_model_with_router_exits_2_before_dialling():
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--insecure", "--model", "/nonexistent")
    assert proc.returncode == 2, proc.stderr
    assert "model '/nonexistent' not found: the path does not exist" in proc.stderr
    assert "failed to connect" not in proc.stderr


def test_a_model_name_unknown_here_is_the_routers_to_judge(tmp_path):
    """A bare name no local model has (``gpt-4``) goes to the router, which answers for what it serves:
    here, no router listens (exit 1, a service failure), not "the path does not exist" (exit 2)."""
    proc = run_cli("generate", "--prompt", "hi", "--router", "127.0.0.1:1", "--insecure", "--model", "gpt-4")
    assert proc.returncode == 1, proc.stderr
    assert "not found" not in proc.stderr


def test_model_with_router_names_the_model_the_router_must_serve(default_model_path, monkeypatch):
    """--model with --router is honoured: its name goes in the request, so a router serving another model
    refuses it (ModelNotFound) instead of silently answering with its own."""
    from typer.testing import CliRunner

    import infinite_llm.client
    from infinite_llm.cli import app

    asked = {}

    class FakeClient:
        def __init__(self, target, **kwargs):
            asked["target"] = target

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def stream(self, prompt, **kwargs):
            asked.update(prompt=prompt, model=kwargs["model"])
            return iter(())

    monkeypatch.setattr(infinite_llm.client, "Client", FakeClient)
    argv = ["generate", "--prompt", "hi", "--router", "r:1", "--insecure", "--model", str(default_model_path)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert asked == {"target": "r:1", "prompt": "hi", "model": default_model_path.stem}
    assert CliRunner().invoke(app, argv[:-2]).exit_code == 0
    assert asked["model"] is None  # no --model: whichever model the router serves
    assert CliRunner().invoke(app, [*argv[:-1], "gpt-4"]).exit_code == 0
    assert asked["model"] == "gpt-4"  # a name unknown here: the router judges it


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["serve", "router", "--insecure", "--port", "99999"], "--port"),  # before: listened on 34463
        (["serve", "compute", "--insecure", "--metrics-port", "70000"], "--metrics-port"),
        (["serve", "attention", "--insecure", "--health-port", "-1"], "--health-port"),
        (["up", "--manager-port", "70000"], "--manager-port"),  # before: an OverflowError traceback
        (["up", "--gateway-port", "-1"], "--gateway-port"),
        (["serve", "router", "--insecure", "--manager", "127.0.0.1:99999"], "--manager"),
        (["serve", "router", "--insecure", "--compute", "ipv4:127.0.0.1:1,127.0.0.1:65536"], "--compute"),
        (["serve", "gateway", "--insecure", "--router", "[::1]:70000"], "--router"),
        (
            ["generate", "--insecure", "--router", "127.0.0.1:99999", "--prompt", "hi"],
            "--router",
        ),  # before: dialled 34463
        (["status", "--manager", "dns:///manager:99999"], "--manager"),
    ],
)
def test_a_port_out_of_range_is_refused_naming_its_flag(argv, flag):
    """gRPC wraps a port above 65535 around (99999 -> 34463, perhaps another service): every port flag and
    every flag naming a gRPC target refuses one, before anything starts (exit 2)."""
    from typer.testing import CliRunner

    from infinite_llm.cli import app

    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output, result.output


def test_targets_are_checked_the_same_way_by_channels_and_the_sdk():
    from infinite_llm.client import Client, InvalidRequest
    from infinite_llm.rpc.channels import sync_channel
    from infinite_llm.rpc.options import check_target

    for good in ("127.0.0.1:65535", "dns:///manager.ns.svc:50050", "ipv4:10.0.0.1:1,10.0.0.2:2", "[::1]:0", "::1"):
        assert check_target(good) == good
    with pytest.raises(ValueError, match="port 65536 is out of range"):
        check_target("ipv4:10.0.0.1:1,10.0.0.2:65536")
    assert check_target("") == ""  # as before: a call on it fails with an RpcError, as for a peer gone
    with pytest.raises(ValueError, match="port 99999"):
        sync_channel("127.0.0.1:99999", tls=None)
    with pytest.raises(InvalidRequest, match="port 99999") as info:
        Client("127.0.0.1:99999", tls=None)
    assert info.value.param == "target"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kv-blocks", "0"], "Invalid value for '--kv-blocks'"),
        (["--num-partitions", "0"], "Invalid value for '--num-partitions'"),
        (["--kv-blocks", "2", "--num-partitions", "3"], "Invalid value for --kv-blocks: 2 rBlocks for 3 partitions"),
    ],
)
def test_kv_blocks_and_partitions_are_checked_against_the_flags_not_the_engine_configs_fields(args, says):
    from typer.testing import CliRunner

    from infinite_llm.cli import app

    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", *args])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.replace("│", " ").split()), result.output
