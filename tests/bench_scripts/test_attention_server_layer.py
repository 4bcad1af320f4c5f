"""``benchmarks/attention_server_layer.py`` on a 2-layer toy shape: the script runs end to end (a real server
process over gRPC, a real echo process) and prints its breakdown, so a change to the servicer or the codec
breaks CI rather than the next measurement."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_run_prints_the_in_process_pieces_and_the_server_cpu_split():
    args = ["--batch", "2", "--context", "20", "--num-layers", "2", "--steps", "2", "--block-size", "16"]
    run = subprocess.run(
        [sys.executable, "benchmarks/attention_server_layer.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("decode layer: batch 2, 20 tokens of KV per sequence on the server")
    pieces = [line.split()[2] for line in lines if line.startswith("  in process")]
    assert pieces == ["parse", "decode", "holder.attend_layer", "of", "encode"]
    for name in ("attention server over gRPC", "bare gRPC echo, same bytes"):
        (line,) = [line for line in lines if line.strip().startswith(name)]
        assert re.search(r"wall [\d.]+ ms/layer, server CPU [\d.]+ ms/layer, client CPU [\d.]+ ms/layer$", line)
    split = re.fullmatch(
        r"server CPU per layer ([\d.]+) ms = attention path ([\d.]+) \(in process\) \+ gRPC, asyncio and "
        r"servicer (-?[\d.]+); the echo's floor is ([\d.]+) \((-?[\d.]+x|n/a: too short to measure)\)",
        lines[-1],
    )
    assert split is not None, lines[-1]
    total, path, rest = (float(split.group(i)) for i in (1, 2, 3))
    assert abs(total - path - rest) < 0.002  # the split adds up (3 decimals printed)
