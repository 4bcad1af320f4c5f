"""Staying registered with the global manager: the loop that attention servers and compute instances share.

The manager keeps a member's key under an etcd lease that each heartbeat refreshes; a member that stops
heartbeating (dies) vanishes when the lease expires. A heartbeat answered NOT_FOUND means the lease already
expired (or the manager lost it): register again. An unreachable manager is retried every ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)
RETRY_S = 1.0  # wait before retrying an unreachable manager (seconds)
MIN_HEARTBEAT_S = 0.5  # never heartbeat more often than this (seconds)


class LeaseKeeper:
    """Runs ``register`` (returns the lease TTL in seconds), then ``heartbeat`` every TTL/3 until the
    manager answers NOT_FOUND, then registers again; both raise ``grpc.RpcError`` on failure.

    ``registered`` is set after the first successful registration.
    """

    def __init__(
        self, name: str, register: Callable[[], Awaitable[float]], heartbeat: Callable[[], Awaitable[None]]
    ) -> None:
        self.name = name
        self._register, self._heartbeat = register, heartbeat
        self._task: asyncio.Task | None = None
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lease-{self.name}")

    async def stop(self) -> None:
        """Stop heartbeating (the lease lapses after its TTL unless the member deregisters)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                ttl = await self._register()
                self.registered.set()
                while await self._beat():
                    await asyncio.sleep(max(ttl / 3, MIN_HEARTBEAT_S))
                log.warning("lease of %s expired; registering again", self.name)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    log.error("the manager refuses %s: %s; retrying", self.name, e.details())  # fix the config
                else:
                    log.warning("manager unreachable (%s); retrying", e.code().name)
                await asyncio.sleep(RETRY_S)

    async def _beat(self) -> bool:
        """One heartbeat; False when the manager no longer knows this member."""
        try:
            await self._heartbeat()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True
