"""Under pytest-xdist (``make test``), the workers together use no more OpenMP threads than the machine has
cores, and the processes a worker starts get the same share (``tests/conftest.py`` says why)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import THREADS_FROM_CALLER, XDIST_WORKERS, worker_threads

pytestmark = [
    pytest.mark.skipif(XDIST_WORKERS == 1, reason="a serial run keeps torch's default threads"),
    pytest.mark.skipif(THREADS_FROM_CALLER, reason="the caller's OMP_NUM_THREADS wins"),
]


def test_the_workers_threads_fit_the_cores():
    assert torch.get_num_threads() == worker_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_a_started_process_gets_the_workers_share():
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout) == torch.get_num_threads()
