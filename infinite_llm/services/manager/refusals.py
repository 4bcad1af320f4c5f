"""Registrations the leading manager refused lately, so that ``infinite-llm status`` shows a member that cannot
join (another model or dtype, another block size, an id held by another identity) instead of leaving it
invisible: a refused member keeps retrying (``services/lease_keeper.py``, with a growing pause) and reports
NOT_SERVING meanwhile, but the cluster view would otherwise never name it.

Kept in memory on the manager that refused (not in etcd): a refusal is a fact about a live process that keeps
retrying, so a new leader learns it again at that process's next attempt. An entry lapses ``ttl_s`` after the
member's last refused attempt (it stopped retrying: it exited or was fixed and runs under another id), and a
successful registration of the same member removes it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

REFUSAL_TTL_S = 90.0  # a refusal is listed this long after the member's last refused attempt (seconds)
MAX_REFUSALS = 256  # entries kept at most (the oldest attempt goes first): a bound on what a caller can grow


@dataclass(frozen=True)
class Refusal:
    """One member's latest refused registration. ``kind``: ``"attention"`` or ``"compute"``; ``first_at`` and
    ``last_at``: the manager's monotonic clock (seconds) at the first and the latest refused attempt;
    ``times``: refused attempts since the first."""

    kind: str
    member_id: str
    address: str
    reason: str
    first_at: float
    last_at: float
    times: int = 1


class Refusals:
    """The latest refusal per ``(kind, member_id)``."""

    def __init__(
        self,
        ttl_s: float = REFUSAL_TTL_S,
        max_entries: int = MAX_REFUSALS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._by_member: dict[tuple[str, str], Refusal] = {}
        self.on_note: Callable[[str], None] | None = None  # told the kind of every refused attempt (metrics)

    def note(self, kind: str, member_id: str, address: str, reason: str) -> None:
        """Record a refused attempt (a repeat of the same member counts, and takes the new address and reason)."""
        now = self._clock()
        key = (kind, member_id)
        old = self._by_member.pop(key, None)
        if old is None:
            self._by_member[key] = Refusal(kind, member_id, address, reason, now, now)
        else:
            self._by_member[key] = replace(old, address=address, reason=reason, last_at=now, times=old.times + 1)
        while len(self._by_member) > self.max_entries:  # dicts keep insertion order: the first is the stalest
            del self._by_member[next(iter(self._by_member))]
        if self.on_note is not None:
            self.on_note(kind)

    def forget(self, kind: str, member_id: str) -> None:
        """The member registered: it is refused no more."""
        self._by_member.pop((kind, member_id), None)

    def recent(self) -> list[Refusal]:
        """Refusals whose last attempt is under ``ttl_s`` old, by kind and member id."""
        now = self._clock()
        for key in [k for k, r in self._by_member.items() if now - r.last_at >= self.ttl_s]:
            del self._by_member[key]
        return sorted(self._by_member.values(), key=lambda r: (r.kind, r.member_id))
