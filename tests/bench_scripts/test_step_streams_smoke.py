"""``benchmarks/step_streams.py``: both modes of the gRPC data plane over real attention-server processes.
Its figures are the script's business; what is asserted is what it compares: kept streams start no thread
a step, one stream a step does (the blocking gRPC API's consumer and channel threads)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_kept_streams_start_no_thread_a_step_and_one_stream_a_step_does(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    step_streams = importlib.import_module("step_streams")
    try:
        monkeypatch.setattr(sys, "argv", ["step_streams.py", "--rounds", "2", "--steps", "3", "--batches", "2"])
        assert step_streams.main() == 0
    finally:
        for name in ("step_streams", "mesh_gpu", "engine_gpu", "gpu_timing"):
            sys.modules.pop(name, None)
    out = capsys.readouterr().out
    kept = re.search(r"batch  2: one stream per server +[\d.]+ ms a step \(median\), +([\d.]+) threads", out)
    per_step = re.search(r"batch  2: one stream per step +[\d.]+ ms a step \(median\), +([\d.]+) threads", out)
    assert kept and per_step, out
    assert float(kept.group(1)) == 0.0 and float(per_step.group(1)) >= 1.0, out
    assert re.search(r"batch  2: per step / per server \d+\.\d\dx", out), out
