"""``benchmarks/pooled_vs_static.py``'s traces (the runs themselves take minutes of meshes: not in CI).

The skewed trace must make instance 0 a debtor (its requests' KV is more than its home holds at once) and
leave instance 1's home mostly idle, and every request must name its instance, so static and pooled serve
the same requests on the same instances."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HOME_BLOCKS, BLOCK_SIZE = 24, 16


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("pooled_vs_static")
    sys.modules.pop("pooled_vs_static", None)


def _blocks(r) -> int:
    return -(-(len(r.prompt) + r.max_tokens) // BLOCK_SIZE)


def test_the_skewed_trace_has_a_memory_bound_debtor_and_an_idle_creditor(bench):
    tokens = list(range(5000))
    trace = bench.skewed_trace(tokens, n_busy=32, n_idle=2, home_tokens=HOME_BLOCKS * BLOCK_SIZE)
    busy = [r for r in trace if r.instance == 0]
    idle = [r for r in trace if r.instance == 1]
    assert (len(busy), len(idle), len(trace)) == (32, 2, 34)
    assert [(len(r.prompt), r.max_tokens) for r in busy] == [(80, 30)] * 32
    assert HOME_BLOCKS // _blocks(busy[0]) == 3  # its home holds 3 at once: 32 queue behind them
    assert sum(_blocks(r) for r in idle) <= HOME_BLOCKS // 3  # two thirds of the creditor's home stay free
    assert len({tuple(r.prompt[:BLOCK_SIZE]) for r in busy}) == 32  # no shared first block: no prefix hits


def test_the_long_tail_trace_goes_through_the_router_with_a_few_requests_longer_than_a_home(bench):
    home_tokens = HOME_BLOCKS * BLOCK_SIZE
    trace = bench.long_tail_trace(list(range(5000)), n_short=24, n_long=3, home_tokens=home_tokens)
    assert len(trace) == 27 and all(r.instance is None for r in trace)
    longer = [len(r.prompt) + r.max_tokens for r in trace if len(r.prompt) + r.max_tokens > home_tokens]
    assert len(longer) == 3 and max(longer) <= 2 * home_tokens
    assert max(longer) >= 0.95 * 2 * home_tokens  # the target: pooled serves >= 0.95 of the pool
