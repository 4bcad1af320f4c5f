"""A background loop that runs one async ``tick`` every ``interval_s`` seconds until stopped.

The manager's reconciler, planner and autoscaler each run this way. A tick that fails never ends the loop:
an expected failure (an :class:`~infinite_llm.core.errors.InfiniteLLMError`: etcd unreachable, lost
leadership, a server gone) is logged as a warning without a traceback; anything else is a bug, logged with
its traceback. Either way the next tick comes: a loop that died on one bad pass would leak rBlocks for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from infinite_llm.core.errors import InfiniteLLMError

log = logging.getLogger(__name__)


class PeriodicTask:
    """``tick()`` every ``interval_s`` seconds (> 0) on the running event loop, named ``name`` in logs.

    ``tick_first``: run the first tick at once (else after one interval).
    """

    def __init__(
        self, name: str, tick: Callable[[], Awaitable[object]], interval_s: float, tick_first: bool = False
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"{name}: interval_s must be > 0, got {interval_s}")
        self.name, self.interval_s, self.tick_first = name, interval_s, tick_first
        self._tick = tick
        self._task: asyncio.Task | None = None
        self.failures = 0  # ticks that raised, since start

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop on the running event loop (``RuntimeError`` if it already runs)."""
        if self.running:
            raise RuntimeError(f"{self.name} already runs")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the loop and wait for it (a tick in progress is cancelled)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        if not self.tick_first:
            await asyncio.sleep(self.interval_s)
        while True:
            try:
                await self._tick()
            except InfiniteLLMError as e:
                self.failures += 1
                log.warning("%s: tick failed: %s; retrying in %.1f s", self.name, e, self.interval_s)
            except Exception:
                self.failures += 1
                log.exception("%s: tick failed; retrying in %.1f s", self.name, self.interval_s)
            await asyncio.sleep(self.interval_s)
