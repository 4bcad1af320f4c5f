"""Staying registered with the global manager: the loop that attention servers and compute instances share.

The manager keeps a member's key under an etcd lease that each heartbeat refreshes; a member that stops
heartbeating (dies) vanishes when the leading manager has not heard from it for its TTL. A heartbeat answered
NOT_FOUND means the registration already ended (or the manager lost it): register again. An unreachable
manager (a failover, a restart) is sent the heartbeat again every ``RETRY_S``: the registration outlives a
failover, so it registers again only when a manager answers NOT_FOUND.

A stall of this process (SIGSTOP, a long pause) is seen by a watchdog task whose short timer fires late, wherever
the stall caught the process: asleep between heartbeats or awaiting one. Only a heartbeat sent after the stall
ended and answered OK proves the lease outlived it; one sent before (its reply read after the stall) proves
nothing, since the lease may have lapsed while the process was stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)
RETRY_S = 1.0  # wait before retrying an unreachable manager (seconds)
MIN_HEARTBEAT_S = 0.5  # never heartbeat more often than this (seconds)
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # the call may not have arrived
# The manager answered and will not take this member as it is (another block size or KV layout, an id held by
# another identity, a malformed field, a certificate of another role): retrying soon cannot help, fixing can.
REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
REFUSED_RETRY_MAX_S = 16.0  # the pause after a refusal doubles from RETRY_S up to this (seconds)
WATCH_TICK_S = 0.1  # the stall watchdog's timer period (seconds)


class LeaseKeeper:
    """Runs ``register`` (returns the TTL in seconds), then ``heartbeat`` every TTL/3 until the manager answers
    NOT_FOUND, then registers again; both raise ``grpc.RpcError`` on failure (an unreachable manager's
    heartbeat is sent again, other failures register again).

    A refused registration (``REFUSED``: the member's config must change, or the member it clashes with
    leave) is logged as an error and tried again after a pause that doubles up to ``REFUSED_RETRY_MAX_S``;
    ``refused`` holds the manager's reason until a registration succeeds, and ``on_refused`` (optional) is
    awaited with the reason when the member becomes refused and with ``None`` when it is admitted again (an
    attention server or compute instance reports NOT_SERVING meanwhile, so probes and clients pass it by).

    ``registered`` is set after the first successful registration. ``on_stalled`` is awaited before
    registering again when this process itself stalled (SIGSTOP, a long pause: its timers fired at least a
    heartbeat interval late) since its last good heartbeat: its lease has likely lapsed while it could not tell,
    and the cluster may have counted it dead (an attention server drops its KV there: fenced, it rejoins
    empty). A manager that was unreachable is no stall: the member keeps its state and registers again.
    """

    def __init__(
        self,
        name: str,
        register: Callable[[], Awaitable[float]],
        heartbeat: Callable[[], Awaitable[None]],
        on_stalled: Callable[[], Awaitable[None]] | None = None,
        on_refused: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self._register, self._heartbeat, self._on_stalled = register, heartbeat, on_stalled
        self._on_refused = on_refused
        self.refused: str | None = None  # the manager's reason while it refuses this member's registration
        self._refused_pause_s = RETRY_S  # the pause before the next attempt after a refusal (doubles)
        self._tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()
        self.stalled_s = 0.0  # the longest stall not yet outlived by a good heartbeat (seconds)
        self._stall_ended_at = float("-inf")  # loop time the latest stall was seen to end
        self._interval_s = RETRY_S

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name=f"lease-{self.name}"),
            asyncio.create_task(self._watch(), name=f"stall-watch-{self.name}"),
        ]

    async def stop(self) -> None:
        """Stop heartbeating (the lease lapses after its TTL unless the member deregisters)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _run(self) -> None:
        registered = False  # a heartbeat may keep the registration alive (else: register)
        while True:
            try:
                if not registered:
                    await self._fence_if_stalled()
                    sent = asyncio.get_running_loop().time()
                    ttl = await self._register()
                    await self._admitted()
                    self.registered.set()
                    registered = True
                    self._interval_s = max(ttl / 3, MIN_HEARTBEAT_S)
                    self._outlived(sent)
                while await self._beat():
                    await asyncio.sleep(self._interval_s)
                registered = False
                log.warning("lease of %s expired; registering again", self.name)
            except grpc.RpcError as e:
                # An unreachable manager (a failover, a restart) has not forgotten this member: heartbeat
                # again, and register only when a manager says it does not know it (NOT_FOUND).
                registered = registered and e.code() in UNREACHABLE
                if e.code() in REFUSED:
                    await asyncio.sleep(await self._refusal(e.details() or e.code().name))
                else:
                    log.warning("manager unreachable (%s); retrying", e.code().name)
                    await asyncio.sleep(RETRY_S)

    async def _refusal(self, reason: str) -> float:
        """The manager refused this member: record it, tell ``on_refused`` (the first time, or a new reason),
        and return the pause before the next attempt (seconds)."""
        pause, self._refused_pause_s = self._refused_pause_s, min(self._refused_pause_s * 2, REFUSED_RETRY_MAX_S)
        log.error("the manager refuses %s: %s; not serving, trying again in %.0f s", self.name, reason, pause)
        if reason != self.refused:
            self.refused = reason
            await self._tell_refused(reason)
        return pause

    async def _admitted(self) -> None:
        self._refused_pause_s = RETRY_S
        if self.refused is not None:
            self.refused = None
            log.info("the manager admits %s now: serving", self.name)
            await self._tell_refused(None)

    async def _tell_refused(self, reason: str | None) -> None:
        if self._on_refused is None:
            return
        try:
            await self._on_refused(reason)
        except Exception:  # a failing callback must not end the registration loop
            log.exception("on_refused of %s failed", self.name)

    async def _watch(self) -> None:
        """Record every lateness of a ``WATCH_TICK_S`` timer of at least a heartbeat interval: a stall."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + WATCH_TICK_S
            await asyncio.sleep(WATCH_TICK_S)
            late = loop.time() - due
            if late >= self._interval_s:
                self.stalled_s = max(self.stalled_s, late)
                self._stall_ended_at = loop.time()

    def _outlived(self, sent: float) -> None:
        """A call sent at loop time ``sent`` found the lease live: every stall that ended before it cost nothing."""
        if self._stall_ended_at <= sent:
            self.stalled_s = 0.0

    async def _fence_if_stalled(self) -> None:
        if self.registered.is_set() and self.stalled_s >= self._interval_s and self._on_stalled is not None:
            log.warning("%s stalled %.1f s; fencing before registering again", self.name, self.stalled_s)
            await self._on_stalled()
            self.stalled_s = 0.0

    async def _beat(self) -> bool:
        """One heartbeat; False when the manager no longer knows this member."""
        sent = asyncio.get_running_loop().time()
        try:
            await self._heartbeat()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        self._outlived(sent)
        return True
