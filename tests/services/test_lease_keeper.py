"""The lease loop's stall detection (fencing): a member whose process stalled past a heartbeat interval fences
itself before registering again, wherever the stall caught it: awaiting a heartbeat (its OK reply read after the
stall proves nothing) or asleep between two. A heartbeat sent after the stall and answered OK clears it; a
manager that was only unreachable is no stall.

A stall is a blocking ``time.sleep`` on the event loop's thread, which delays every timer of the process as
SIGSTOP does; ``register`` and ``heartbeat`` are scripted coroutines standing in for the manager's RPCs (the
real ones, with SIGSTOP, run in ``tests/e2e/test_mesh_orphans.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from infinite_llm.services import lease_keeper
from infinite_llm.services.lease_keeper import LeaseKeeper

TTL_S = 1.5  # heartbeat interval TTL/3 = 0.5 s
STALL_S = 1.2  # over two heartbeat intervals, under the TTL


class Code(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


def run(script: list[Callable[[], None]], registrations: int = 2) -> list[str]:
    """Run a keeper whose n-th heartbeat calls ``script[n]`` (which may stall or raise; past the script:
    OK) until it has registered ``registrations`` times; the events in order."""
    events: list[str] = []

    async def main() -> None:
        done = asyncio.Event()
        beats = 0

        async def register() -> float:
            events.append("register")
            if events.count("register") == registrations:
                done.set()
            return TTL_S

        async def heartbeat() -> None:
            nonlocal beats
            beats += 1
            step = script[beats - 1] if beats <= len(script) else ok
            step()
            events.append("beat")

        async def fence() -> None:
            events.append("fence")

        keeper = LeaseKeeper("member", register, heartbeat, fence)
        keeper.start()
        try:
            await asyncio.wait_for(done.wait(), 30)
        finally:
            await keeper.stop()

    asyncio.run(main())
    ends = [i for i, e in enumerate(events) if e == "register"]
    return events[: ends[registrations - 1] + 1]  # a beat may follow before the keeper stops


def ok() -> None:
    pass


def stall() -> None:
    time.sleep(STALL_S)


def not_found() -> None:
    raise Code(grpc.StatusCode.NOT_FOUND)


def unavailable() -> None:
    raise Code(grpc.StatusCode.UNAVAILABLE)


def test_a_stall_while_awaiting_a_heartbeat_fences_before_registering_again():
    """The heartbeat's OK was read after the stall (as a reply that waited while the process was stopped)."""
    assert run([ok, stall, not_found]) == ["register", "beat", "beat", "fence", "register"]


def test_a_stall_between_heartbeats_fences_before_registering_again():
    def stall_after_this_beat() -> None:
        asyncio.get_running_loop().call_soon(time.sleep, STALL_S)  # the loop blocks once this beat returns

    assert run([stall_after_this_beat, not_found]) == ["register", "beat", "fence", "register"]


def test_a_good_heartbeat_sent_after_the_stall_clears_it():
    assert run([ok, stall, ok, not_found]) == ["register", "beat", "beat", "beat", "register"]


def deadline_exceeded() -> None:
    raise Code(grpc.StatusCode.DEADLINE_EXCEEDED)


def test_an_unreachable_manager_is_no_stall_and_is_sent_the_heartbeat_again():
    """A heartbeat that fails UNAVAILABLE (no manager leads: a failover) or DEADLINE_EXCEEDED (a frozen one) is
    sent again after ``RETRY_S``, without fencing and without registering again: the registration outlives a
    failover (registering anew gave every member a new lease and a "registered" log line at each one). Only
    a manager's NOT_FOUND makes it register again."""
    assert run([ok, unavailable, deadline_exceeded, ok, not_found]) == ["register", "beat", "beat", "register"]


def test_a_refusal_that_is_not_unreachability_registers_again():
    def refused() -> None:
        raise Code(grpc.StatusCode.FAILED_PRECONDITION)

    assert run([ok, refused]) == ["register", "beat", "register"]


def test_a_refused_registration_is_told_once_per_reason_and_retried_after_a_doubling_pause(monkeypatch):
    """The manager refuses the first four registrations (the third for another reason), then admits: the
    callback hears each new reason once and ``None`` at admission; the pauses double from ``RETRY_S`` up to
    ``REFUSED_RETRY_MAX_S`` (lower bounds only: a loaded machine may pause longer)."""
    monkeypatch.setattr(lease_keeper, "RETRY_S", 0.05)
    monkeypatch.setattr(lease_keeper, "REFUSED_RETRY_MAX_S", 0.2)
    reasons = ["other layout", "other layout", "id taken", "id taken"]
    attempts: list[float] = []
    told: list[str | None] = []

    async def main() -> None:
        admitted = asyncio.Event()

        async def register() -> float:
            attempts.append(time.monotonic())
            if len(attempts) <= len(reasons):
                raise Refused(reasons[len(attempts) - 1])
            admitted.set()
            return 30.0

        async def heartbeat() -> None:
            pass

        async def on_refused(reason: str | None) -> None:
            told.append(reason)

        keeper = LeaseKeeper("member", register, heartbeat, on_refused=on_refused)
        keeper.start()
        try:
            await asyncio.wait_for(admitted.wait(), 10)
            assert keeper.refused is None
        finally:
            await keeper.stop()

    asyncio.run(main())
    assert told == ["other layout", "id taken", None]
    pauses = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert len(pauses) == 4
    for pause, least in zip(pauses, [0.05, 0.1, 0.2, 0.2], strict=True):
        assert pause >= least - 0.01, pauses


class Refused(Code):
    def __init__(self, reason: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION)
        self.reason = reason

    def details(self) -> str:
        return self.reason
