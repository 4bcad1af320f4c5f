"""Flags of ``infinite-llm serve compute|router`` for the cluster view, and of ``serve manager`` for etcd's
mTLS: bad values exit 2 naming the flag, before any model is loaded or any service is called (a real
process, as a user runs it)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

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
        (["gateway", "--max-choices-per-request", "0"], "--max-choices-per-request must be >= 1, got 0"),
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
        (["--etcd", "127.0.0.1:99999"], "--etcd must be HOST:PORT or https://HOST:PORT (port 0 to 65535)"),
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


def test_the_gateways_choice_cap_defaults_to_the_gateways_own():
    from infinite_llm.cli_serve import serve_gateway
    from infinite_llm.services.gateway.params import MAX_CHOICES_PER_REQUEST

    default = next(
        p.default for p in inspect.signature(serve_gateway).parameters.values() if p.name == "max_choices_per_request"
    )
    assert default == MAX_CHOICES_PER_REQUEST


def test_tables_are_not_cut_to_80_columns_when_stdout_is_not_a_terminal(monkeypatch):
    from rich.table import Table

    from infinite_llm.cli_options import stdout_console

    monkeypatch.delenv("COLUMNS", raising=False)  # pytest captures stdout: not a terminal
    table = Table()
    table.add_column("log")
    table.add_row("/tmp/infinite-llm-mesh-0qu2z9m3/" + "x" * 100 + ".log")
    console = stdout_console()
    with console.capture() as captured:
        console.print(table)
    assert "x" * 100 + ".log" in captured.get()  # whole: a log path one can open
    monkeypatch.setenv("COLUMNS", "100")
    assert stdout_console().width == 100  # COLUMNS still decides


@pytest.mark.parametrize("flag", ["--gateway-port", "--port", "--manager-port"])
def test_up_with_a_busy_port_exits_2_naming_it_before_starting_anything(flag, tmp_path):
    """A real listening socket holds the port: `up` refuses at once (not ~20 s later, when the gateway fails
    to bind) and makes no run directory (TMPDIR is the test's: nothing named infinite-llm-* appears)."""
    import socket
    import time

    from infinite_llm.state.etcd_launcher import free_port

    ports = {"--port": free_port(), "--manager-port": free_port(), "--gateway-port": free_port()}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports[flag] = busy.getsockname()[1]
        env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "250"}
        start = time.monotonic()
        proc = subprocess.run(
            [*CLI, "up", "--insecure", *(a for f, p in ports.items() for a in (f, str(p)))],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    flat = " ".join(proc.stderr.replace("│", " ").split())
    assert proc.returncode == 2, proc.stderr
    assert f"Invalid value for {flag}: port {ports[flag]} is in use on 127.0.0.1" in flat, proc.stderr
    assert f"choose another port with {flag}" in flat
    assert time.monotonic() - start < 30 and "starting the mesh" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--dtype", "float64"], "unknown dtype 'float64'; use float32, bfloat16 or float16"),
        (["--device", "cuda"], "Invalid value for --device: 'cuda': this machine has no CUDA device"),
        # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 16 tokens x K and V x 4 bytes = 720 KiB per rBlock
        (["--kv-memory", "0"], "Invalid value for --kv-memory: kv_memory 0B holds no rBlock: one takes 720.0KiB"),
        (["--kv-memory", "719KiB"], "kv_memory 719.0KiB holds no rBlock: one takes 720.0KiB"),
    ],
)
def test_up_with_a_dtype_device_or_kv_memory_it_cannot_use_exits_2_before_starting_anything(args, says, tmp_path):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "250"}
    proc = subprocess.run([*CLI, "up", "--insecure", *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert says in " ".join(proc.stderr.replace("│", " ").split())
    assert [p.name for p in tmp_path.iterdir()] == []


def test_up_refuses_one_port_given_to_two_flags(tmp_path):
    from infinite_llm.state.etcd_launcher import free_port

    port = str(free_port())
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "250"}
    proc = subprocess.run(
        [*CLI, "up", "--insecure", "--port", port, "--manager-port", "0", "--gateway-port", port],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"Invalid value for --gateway-port: port {port} is also given to --port" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == []


def test_up_with_a_bad_api_key_exits_2_before_starting_anything(tmp_path):
    """The router and the gateway refuse such a key at start: `up` refuses it before anything starts, and
    never prints the key."""
    from infinite_llm.state.etcd_launcher import free_port

    ports = [a for f in ("--port", "--manager-port", "--gateway-port") for a in (f, str(free_port()))]
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "250", "INFINITE_LLM_API_KEY": "bad key!"}
    proc = subprocess.run([*CLI, "up", "--insecure", *ports], capture_output=True, text=True, timeout=120, env=env)
    flat = " ".join(proc.stderr.replace("│", " ").split())
    assert proc.returncode == 2, proc.stderr
    assert "Invalid value: INFINITE_LLM_API_KEY: an API key must be one RFC 6750 bearer token" in flat
    assert "bad key!" not in proc.stderr and "starting the mesh" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize(
    "role,args,env_key",
    [
        ("router", ["--api-key", "two words"], None),
        ("router", [], "two words"),  # click would have split it into the keys 'two' and 'words'
        ("router", ["--api-key", "good-key", "--api-key", "a,b"], None),
        ("gateway", ["--api-key", "two words"], None),
        ("gateway", [], "tab\tkey"),
    ],
)
def test_an_api_key_that_is_not_one_bearer_token_exits_2_without_echoing_it(role, args, env_key):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("INFINITE_LLM_API_KEY", None)
    if env_key is not None:
        env["INFINITE_LLM_API_KEY"] = env_key
    extra = ["--manager", "127.0.0.1:1"] if role == "router" else []
    proc = subprocess.run([*CLI, "serve", role, *extra, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    flat = " ".join(proc.stderr.replace("│", " ").split())
    assert "an API key must be one RFC 6750 bearer token" in flat, proc.stderr
    assert "words" not in proc.stderr and "tab" not in proc.stderr  # the key itself is never printed


def test_bearer_tokens_pass_the_key_check_and_the_rest_do_not():
    from infinite_llm.rpc.interceptors.api_key import ApiKeyInterceptor, check_api_key

    for key in ("s3cret", "up-test-key-7f3a", "sk-Ab.C_d~e+f/g==", "x"):
        assert check_api_key(key) == key
    for key in ("", "a b", "a,b", "a\nb", "=abc", "ab=c", "ключ"):
        with pytest.raises(ValueError, match="--api-key: an API key must be one RFC 6750 bearer token"):
            check_api_key(key)
    assert ApiKeyInterceptor(["k1", "", "k2"]).api_keys == [b"k1", b"k2"]
    with pytest.raises(ValueError):
        ApiKeyInterceptor(["k1", "k 2"])


def test_status_pointed_at_another_service_says_so():
    """A real gRPC server that is not a manager (it implements nothing): the error names the address and the
    flag instead of gRPC's bare 'Method not found!'."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.run(
            [*CLI, "status", "--manager", f"127.0.0.1:{port}", "--insecure"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "250"},
        )  # fmt: skip
    finally:
        server.stop(0)
    assert proc.returncode == 1, proc.stderr
    assert f"127.0.0.1:{port} does not answer the global manager's ClusterState (Method not found!)" in proc.stderr
    assert "give the manager's with --manager" in proc.stderr


def test_status_pointed_at_a_standby_or_at_a_bare_list_of_managers_says_what_to_give():
    """A standby manager (health: alive, the GlobalManager service NOT_SERVING) is never sent the call: gRPC's
    client-side health checking reports 'backend unhealthy', which the error explains. A comma-separated
    list without a scheme is no gRPC target: the error shows the ipv4: form."""
    from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
    from tests.manager_stub import serving_manager

    env = {**os.environ, "COLUMNS": "250"}
    with serving_manager(mgrpc.GlobalManagerServicer(), serving=False) as port:
        standby = _status(f"127.0.0.1:{port}", env)
    assert standby.returncode == 1, standby.stderr
    assert f"no manager at 127.0.0.1:{port} leads" in standby.stderr and "a standby refuses" in standby.stderr
    bare = _status("127.0.0.1:1,127.0.0.1:2", env)
    assert bare.returncode == 1, bare.stderr
    want = "'127.0.0.1:1,127.0.0.1:2' is not one target: list several managers as ipv4:127.0.0.1:1,127.0.0.1:2"
    assert want in bare.stderr


def test_status_against_a_manager_that_does_not_answer_says_what_that_means():
    """A manager that takes the call and never answers (frozen: SIGSTOP, a paused VM; or overloaded): after
    the 5 s deadline the error says so and what happens next, not gRPC's bare 'Deadline Exceeded'."""
    import threading

    from infinite_llm.pb.v1 import manager_pb2 as mpb
    from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
    from tests.manager_stub import serving_manager

    release = threading.Event()

    class Stuck(mgrpc.GlobalManagerServicer):
        def GetClusterState(self, request, context):  # noqa: N802, ANN001, ANN201
            release.wait(30)
            return mpb.ClusterStateResponse()

    with serving_manager(Stuck()) as port:
        try:
            stuck = _status(f"127.0.0.1:{port}", {**os.environ, "COLUMNS": "250"})
        finally:
            release.set()
    assert stuck.returncode == 1, stuck.stderr
    flat = " ".join(stuck.stderr.split())
    assert f"no answer from 127.0.0.1:{port} within 5 s (Deadline Exceeded)" in flat, stuck.stderr
    assert "frozen (a stopped process, a paused VM) or overloaded" in flat and flat.endswith("try again")


def _status(manager: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "status", "--manager", manager, "--insecure"], capture_output=True, text=True, timeout=120, env=env
    )


def test_status_lists_refused_registrations_with_their_reason():
    """A member the manager refused (another model or dtype) is in no other table: ``status`` prints it, with
    the manager's reason, under its own title; a cluster without refusals prints no such table."""
    from infinite_llm.pb.v1 import manager_pb2 as mpb
    from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
    from tests.manager_stub import serving_manager

    refusal = mpb.RefusedRegistration(
        kind="attention", member_id="attn-7", address="10.0.0.7:50061", attempts=12, last_refused_ago_s=3.2,
        reason="attention server 'attn-7' keeps KV as bfloat16; give every server the same model and dtype",
    )  # fmt: skip

    class Refusing(mgrpc.GlobalManagerServicer):
        refused = [refusal]

        def GetClusterState(self, request, context):  # noqa: N802, ANN001, ANN201
            return mpb.ClusterStateResponse(manager_id="m1", refused=self.refused)

    env = {**os.environ, "COLUMNS": "250"}
    with serving_manager(Refusing()) as port:
        listed = _status(f"127.0.0.1:{port}", env)
        Refusing.refused = []
        clean = _status(f"127.0.0.1:{port}", env)
    assert listed.returncode == 0, listed.stderr
    assert "refused registrations (not serving; fix and they join)" in listed.stdout
    row = next(line for line in listed.stdout.splitlines() if "attn-7" in line)
    assert row.split("│")[1:-1] == [
        " attention server ", " attn-7 ", " 10.0.0.7:50061 ", "       12 ", " 3 s ago ",
        " attention server 'attn-7' keeps KV as bfloat16; give every server the same model and dtype ",
    ]  # fmt: skip
    assert clean.returncode == 0, clean.stderr
    assert "refused" not in clean.stdout
