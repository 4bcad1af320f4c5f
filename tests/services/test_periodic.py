"""PeriodicTask: ticks on schedule, survives failing ticks (expected errors and bugs alike), stops."""

from __future__ import annotations

import asyncio
import logging

import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.services.periodic import PeriodicTask


def test_a_failing_tick_never_ends_the_loop(caplog):
    async def scenario():
        calls = []

        async def tick():
            calls.append(len(calls))
            if len(calls) == 1:
                raise Unavailable("etcd is down")
            if len(calls) == 2:
                raise KeyError("a bug")

        loop = PeriodicTask("test-loop", tick, 0.01, tick_first=True)
        loop.start()
        with pytest.raises(RuntimeError, match="already runs"):
            loop.start()
        for _ in range(200):
            if len(calls) >= 4:
                break
            await asyncio.sleep(0.01)
        await loop.stop()
        assert len(calls) >= 4 and loop.failures == 2 and not loop.running
        stopped_at = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == stopped_at  # stopped means stopped

    with caplog.at_level(logging.WARNING, logger="infinite_llm.services.periodic"):
        asyncio.run(scenario())
    messages = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert ("WARNING", "test-loop: tick failed: etcd is down; retrying in 0.0 s", False) in messages
    assert ("ERROR", "test-loop: tick failed; retrying in 0.0 s", True) in messages


def test_the_first_tick_waits_one_interval_unless_tick_first():
    async def first_tick_after(tick_first: bool) -> float:
        loop_time = asyncio.get_running_loop().time
        start, seen = loop_time(), asyncio.Event()

        async def tick():
            seen.set()

        loop = PeriodicTask("t", tick, 0.3, tick_first=tick_first)
        loop.start()
        await asyncio.wait_for(seen.wait(), 5)
        await loop.stop()
        return loop_time() - start

    assert asyncio.run(first_tick_after(True)) < 0.2
    assert asyncio.run(first_tick_after(False)) >= 0.3
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        PeriodicTask("t", lambda: None, 0)
