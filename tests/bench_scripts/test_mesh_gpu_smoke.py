"""``benchmarks/mesh_gpu.py --device cpu --tiny``: the GPU mesh benchmark's code path on a 2-layer model.

Real attention-server processes on loopback, a compute engine reaching them over gRPC, HF as the
reference: the greedy tokens of 8 prompts around block and server boundaries must equal HF's and every
rBlock must be back on the servers' free lists, so a change that breaks the script (or the data plane it
drives) fails CI rather than the next GPU session.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def mesh_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its siblings engine_gpu and gpu_timing
    module = importlib.import_module("mesh_gpu")
    yield module
    for name in ("mesh_gpu", "engine_gpu", "gpu_timing"):
        sys.modules.pop(name, None)


def test_tiny_cpu_run_gives_hf_tokens_over_three_server_processes(mesh_gpu, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mesh_gpu.py", "--device", "cpu", "--tiny"])
    assert mesh_gpu.main() == 0
    out = capsys.readouterr().out
    assert "mesh vs HF: 8/8 equal; in-process (3 partitions) vs HF: 8/8" in out
    assert "every rBlock back on the free lists after: yes" in out
    for line in ("batch   1: mesh", "batch   4: mesh", "equality: ok"):
        assert line in out
