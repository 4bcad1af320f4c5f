"""``infinite-llm bench`` as a user runs it: a real process against the real mesh's router and gateway.

A tiny load (4 requests, 2 at a time, 32-token prompts, 8 tokens each with ``ignore_eos``) must complete
in full: the summary table and the JSON agree on the counts, output tokens are exactly 4 x 8, percentiles
are ordered, and the run leaves no rBlock behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import all_blocks_free

CLI = [sys.executable, "-m", "infinite_llm.cli", "bench"]
LOAD = "--num-requests 4 --concurrency 2 --input-len 32 --output-len 8 --seed 1 --timeout 240 --no-progress".split()
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")


def blocks_freed(mesh, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all_blocks_free(mesh) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all_blocks_free(mesh)


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*CLI, *args, *LOAD], capture_output=True, text=True, timeout=300, env=env)


def table_value(stdout: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}\s+(\S+)\s*$", stdout, re.MULTILINE)
    assert match, f"no {label!r} row in:\n{stdout}"
    return match.group(1)


def check_result(result: dict, backend: str) -> None:
    assert result["backend"] == backend
    assert result["model"] == "SmolLM2-135M-Instruct"  # what the mesh serves: the requests named no model
    assert (result["completed"], result["failed"], result["errors"]) == (4, 0, {})
    assert result["total_output_tokens"] == 4 * 8
    assert result["output_throughput"] == pytest.approx(32 / result["duration_s"])
    for name in LATENCIES:
        dist = result[name]
        assert 0 < dist["p50"] <= dist["p90"] <= dist["p99"], (name, dist)
    assert result["ttft_ms"]["p99"] <= result["e2e_latency_ms"]["p99"]


def test_bench_against_the_router_reports_every_request(mesh, tmp_path: Path):
    out = tmp_path / "bench.json"
    proc = run_bench("--backend", "router", "--target", mesh.router_address, "--output-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (table_value(proc.stdout, "Requests completed"), table_value(proc.stdout, "Requests failed")) == ("4", "0")
    assert table_value(proc.stdout, "Output tokens") == "32"
    assert table_value(proc.stdout, "Input tokens") == "128"  # token-id prompts: exact lengths on the router
    result = json.loads(out.read_text())
    check_result(result, "router")
    assert result["total_input_tokens"] == 4 * 32
    assert blocks_freed(mesh)


def test_bench_against_the_gateway_prints_json(mesh):
    if not hasattr(mesh, "gateway_address"):
        pytest.skip("this mesh has no REST gateway")
    proc = run_bench("--backend", "gateway", "--target", mesh.gateway_address, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    check_result(result, "gateway")
    assert result["target"] == f"http://{mesh.gateway_address}/v1"
    assert 4 * 16 <= result["total_input_tokens"] <= 4 * 64  # text prompts sized by a measured tokens per word
    assert blocks_freed(mesh)
