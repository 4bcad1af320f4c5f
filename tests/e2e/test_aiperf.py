"""aiperf 0.13 (NVIDIA's OpenAI-endpoint load generator) against the real gateway of a local mesh: a short
streaming profile of ``/v1/chat/completions`` and one of ``/v1/completions`` (a few requests, tiny prompts,
``ignore_eos``), read back from aiperf's own JSON export. Every request succeeds, and every one reports the
output tokens it asked for, as counted by the server (``usage``) and as streamed (one token per chunk)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from infinite_llm.models.registry import load_tokenizer, resolve_model
from tests.e2e.conftest import API_KEY

# aiperf's dependencies clash with the project's (it pins transformers 5.24 and python-dateutil 4, among ~150
# packages): it runs from its own virtual environment, made by `make aiperf-venv` (`make test` makes it).
AIPERF = Path(__file__).resolve().parents[2] / ".venv-aiperf" / "bin" / "aiperf"
# Set to 1 where aiperf's virtual environment cannot be built (no registry): the test skips, saying so.
SKIP_ENV = "INFINITE_LLM_TESTS_SKIP_AIPERF"
REQUESTS = 4
OUTPUT_TOKENS = 6
PROMPT_TOKENS = 12


@pytest.fixture(scope="module")
def aiperf() -> Path:
    if not AIPERF.exists():
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"{AIPERF} is missing and {SKIP_ENV}=1")
        pytest.fail(f"{AIPERF} is missing: `make aiperf-venv` makes it (or set {SKIP_ENV}=1 to skip)")
    return AIPERF


def run_profile(aiperf: Path, gateway: str, endpoint_type: str, tmp_path: Path) -> dict:
    """One streaming aiperf profile of ``endpoint_type``; returns its summary export
    (``profile_export_aiperf.json``: one stats block per metric)."""
    tokenizer = tmp_path / "tokenizer"
    if not tokenizer.exists():  # aiperf synthesizes its prompts with the served model's tokenizer
        load_tokenizer(resolve_model(None)).save(tokenizer)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    served = httpx.get(f"http://{gateway}/v1/models", headers=headers, trust_env=False).json()["data"][0]["id"]
    out = tmp_path / endpoint_type
    cmd = [str(aiperf), "profile", "--model", served, "--tokenizer", str(tokenizer), "--url", f"http://{gateway}"]
    cmd += ["--api-key", API_KEY, "--endpoint-type", endpoint_type, "--streaming", "--use-server-token-count"]
    cmd += ["--request-count", str(REQUESTS), "--concurrency", "2", "--random-seed", "0"]
    cmd += ["--synthetic-input-tokens-mean", str(PROMPT_TOKENS), "--synthetic-input-tokens-stddev", "0"]
    cmd += ["--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0"]
    cmd += ["--extra-inputs", "ignore_eos:true", "--artifact-dir", str(out), "--ui-type", "none"]
    cmd += ["--workers-max", "1", "--record-processors", "1", "--no-server-metrics", "--no-gpu-telemetry"]
    # aiperf 0.13 looks a tokenizer up only in the hub's cache when HF_HUB_OFFLINE is set, even a local
    # directory; without it, an absolute path loads from disk and nothing is asked of the hub.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # aiperf leaves its memory-mapped dataset (aiperf_mmap_<id>/) in the temp dir unless told where. Not
    # TMPDIR: aiperf's ZeroMQ ipc:// sockets live there too, and a unix socket path has at most 107 bytes.
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(tmp_path)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    (summary,) = out.rglob("profile_export_aiperf.json")
    return json.loads(summary.read_text())


@pytest.mark.parametrize("endpoint_type", ["chat", "completions"])
def test_aiperf_streaming_profile_through_the_gateway(mesh, aiperf, endpoint_type, tmp_path):
    summary = run_profile(aiperf, mesh.gateway_address, endpoint_type, tmp_path)
    assert (summary["is_complete"], summary["was_cancelled"], summary["error_summary"]) == (True, False, [])
    assert summary["request_count"]["avg"] == summary["completed_request_count"]["avg"] == REQUESTS
    assert "error_request_count" not in summary  # aiperf exports it only when a request failed
    assert summary["request_error_rate"]["avg"] == 0
    # ignore_eos: each request streams exactly the max_completion_tokens / max_tokens aiperf asked for, and
    # the server's usage says so (aiperf counts tokens from usage here, and compares them with what it asked)
    usage = summary["usage_completion_tokens"]
    assert (usage["count"], usage["min"], usage["max"]) == (REQUESTS, OUTPUT_TOKENS, OUTPUT_TOKENS)
    assert summary["output_sequence_length"]["sum"] == summary["total_usage_completion_tokens"]["avg"]
    assert summary["osl_mismatch_count"]["avg"] == 0
    if endpoint_type == "completions":  # the synthetic prompt (seeded) is exactly the tokens aiperf made
        assert summary["usage_prompt_tokens"]["min"] == summary["usage_prompt_tokens"]["max"] == PROMPT_TOKENS
    assert summary["time_to_first_token"]["count"] == summary["inter_token_latency"]["count"] == REQUESTS
