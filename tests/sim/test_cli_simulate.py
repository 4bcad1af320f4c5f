"""``infinite-llm simulate`` as a user runs it: a real process, the printed lines exact for a seed."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "infinite_llm.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}  # typer's error box would wrap a long message
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env)


def test_simulate_tiny_prints_the_ratios_beside_the_papers():
    proc = run_cli("simulate", "--setting", "tiny", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("simulate: setting tiny, calibration cpu-smollm2-135m (this machine")
    assert lines[0].endswith("2 accelerators (1 nodes x 2), seed 0, planner on")
    assert lines[1:] == EXPECTED_TINY
    proc = run_cli("simulate", "--setting", "tiny", "--seed", "0", "--no-open-loop")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == [line for line in EXPECTED_TINY if "open-loop" not in line]


def test_simulate_refuses_an_unknown_setting_and_a_calibration_for_another_model():
    proc = run_cli("simulate", "--setting", "huge")
    assert proc.returncode == 2 and "unknown setting 'huge'" in proc.stderr
    proc = run_cli("simulate", "--setting", "paper", "--calibration", "cpu", "--model", "llama2-7b")
    assert proc.returncode == 2 and "fitted for smollm2-135m" in proc.stderr
    proc = run_cli("simulate", "--setting", "tiny", "--admit-bypass-s", "-1")
    assert proc.returncode == 2 and "--admit-bypass-s" in proc.stderr


# This CPU's calibration: a step with a remote share waits ~42 ms more (the gRPC mesh's fan-out measured by
# mesh_overhead.py), so on 2 tiny instances pooling serves longer contexts but slower than static.
EXPECTED_TINY = [
    "smollm2-135m: 2 instances of TP=1 (2,048 KV tokens each, pool 4,096); single TP=1 x PP=1 (4,096)",
    "  short: pooled 37 tok/s (migrations 1, refused 2), static 59 tok/s (refused 3), single 34 tok/s; "
    "prompt+output 145 / 252 / 168 tok/s",
    "  long: pooled 19 tok/s (migrations 0, refused 2), static 49 tok/s (refused 4), single 25 tok/s; "
    "prompt+output 167 / 269 / 173 tok/s",
    "  short open-loop (highest rate sustained with p90 queueing delay <= 30 s): pooled 0.0546 req/s, 15 tok/s "
    "(p90 wait 26.0 s, mean batch 1, home KV used 79%); static 0.156 req/s, 31 tok/s (p90 wait 29.2 s, mean "
    "batch 1, home KV used 63%)",
    "  short regime: mean batch 3 / 2 / 3 of 8, home KV used 79% / 73% / 78% (pooled / static / single)",
    "  long regime: mean batch 2 / 2 / 2 of 8, home KV used 93% / 75% / 76% (pooled / static / single)",
    "  pooled/static short 0.63x (paper 1.35-1.73x): 53% below the paper's range",
    "    why: static instances run batch 2 of 8 at home KV 73%; static refused 1 more request than pooled: "
    "larger than a home, which pooled serves (their prefill and memory count against pooled's output tokens)",
    "  pooled/static short, open-loop 0.49x (paper 1.35-1.73x): 64% below the paper's range",
    "  pooled/single short 1.10x (paper 1.4-5.3x): 22% below the paper's range",
    "  pooled/single long 0.73x (paper 1.4-3.4x): 48% below the paper's range",
    "  pooled/single long, prompt+output tokens 0.97x (paper 1.4-3.4x): 31% below the paper's range",
    "  longest context pooled/static 2.00x (paper 2-19x): within the paper's range",
]
