"""``benchmarks/engine_gpu.py --device cpu --tiny``: the GPU benchmark's code path, on a 2-layer model.

The benchmark itself needs a GPU; this runs every section of it in-process on CPU so a change to the
engine's public API or to the script breaks CI rather than the next (scarce) GPU session.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def engine_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling gpu_timing.py
    module = importlib.import_module("engine_gpu")
    yield module
    sys.modules.pop("engine_gpu", None)
    sys.modules.pop("gpu_timing", None)


def test_tiny_cpu_run_prints_every_section_and_equal_greedy_tokens(engine_gpu, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["engine_gpu.py", "--device", "cpu", "--tiny"])
    assert engine_gpu.main() == 0
    out = capsys.readouterr().out
    assert out.count("4/4 prompts equal") == 2  # 1 and 3 partitions, fp32, vs HF
    for line in ("batch   1: engine", "batch   4: engine", "TTFT    : engine", "decode  : engine",
                 "CUDA graphs batch-1 decode step", "      eager batch-1 decode step", "weight-read floor",
                 "(1/1 sequences with the eager tokens)", "(4/4 sequences with the eager tokens)",
                 "equality: ok"):  # fmt: skip
        assert line in out
