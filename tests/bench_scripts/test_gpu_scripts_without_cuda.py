"""The GPU benchmarks on a machine without CUDA (CI, a laptop): each exits 0 after one line saying so."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", ["engine_gpu", "kernels_gpu", "mesh_gpu"])
def test_without_cuda_a_gpu_benchmark_exits_0_with_one_line(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings (gpu_timing, engine_gpu)
    try:
        module = importlib.import_module(script)
        monkeypatch.setattr(sys, "argv", [f"{script}.py"])
        monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
        assert module.main() == 0
        out = capsys.readouterr().out.strip()
        assert out.count("\n") == 0 and "CUDA" in out
    finally:
        for name in (script, "engine_gpu", "gpu_timing"):
            sys.modules.pop(name, None)
