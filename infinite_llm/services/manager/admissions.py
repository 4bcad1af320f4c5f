"""First come, first served admission across compute instances that place in one pool of KV memory.

Each compute instance admits its own waiting sequences first come, first served (vLLM's policy), but they all
take rBlocks from the same attention servers. Without a cluster-wide order, a long prompt waiting on one
instance can starve: whenever rBlocks free up, another instance admits its next short request into them,
and the long prompt's instance never sees enough free at once (nor do the requests queued behind it there).

So the leading manager keeps a **claim** for every admission it had to refuse: the sequence, its compute
instance, the rBlocks it asked for, and when it first asked. A later admission, from any instance, is refused
while placing it would leave fewer free rBlocks than the older claims of *other* instances need together (an
instance orders its own queue: a sequence it preempted asks before its waiting head, and must not wait for
that head's claim). Growth of running sequences (decodes, later prefill chunks) is never held back, so the
memory drains.

Each refused Place renews its claim, and so does every heartbeat of its instance that lists the sequence as
waiting (a full cluster can keep an instance from asking for minutes). A claim ends when its sequence is
admitted; when a heartbeat of its instance no longer lists it (the request ended while waiting); when its
instance deregisters; when nothing renewed it for ``ttl_s`` (the instance died; an older instance lists
nothing); or when it asks for more than the cluster now holds in all. A release does not end it (a waiting
sequence that matched a cached prefix releases it after each refused admission, and asks again). A claim
stops holding others back ``hold_s`` after it was made: one the planner cannot place anyway (lending
forbidden) must not stall the cluster for good.

Soft state, in the leader's memory only: a new leading term starts with none and rebuilds them from
refusals. The check and the placement after it are not one transaction across sequences: two admissions at
once may both pass a check that only one of them would.
Source: vLLM's FCFS waiting queue, applied across instances (PAPER.md "Managers": the gManager's global view).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from infinite_llm.core.errors import CapacityExhausted

# A claim nothing renewed for this long is dropped (seconds). The manager uses the larger of this and its
# member TTL: three compute heartbeat intervals.
CLAIM_TTL_S = 5.0
# A heartbeat that does not list a claim renewed this recently leaves it: it may have been read just before
# the refusal that made the claim (seconds).
UNLISTED_GRACE_S = 2.0
CLAIM_HOLD_S = 30.0  # a claim holds later admissions back for at most this long after it was made (seconds)


@dataclass
class Claim:
    """A refused admission: ``n_blocks`` rBlocks asked for, first at ``since`` and last at ``renewed``
    (``time.monotonic()`` seconds)."""

    n_blocks: int
    since: float
    renewed: float
    owner: str = ""  # the compute instance that asked ('' = not told)


class AdmissionClaims:
    """Claims of refused admissions, oldest first; not thread-safe (the manager's event loop owns it)."""

    def __init__(
        self, ttl_s: float = CLAIM_TTL_S, hold_s: float = CLAIM_HOLD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0 or hold_s < 0:
            raise ValueError(f"ttl_s must be > 0 and hold_s >= 0, got {ttl_s}, {hold_s}")
        self.ttl_s, self.hold_s, self._clock = ttl_s, hold_s, clock
        self._claims: dict[str, Claim] = {}

    def check(self, seq_id: str, n_blocks: int, free_blocks: int, capacity_blocks: int, owner: str = "") -> None:
        """Admit ``seq_id``'s first ``n_blocks`` rBlocks only if ``free_blocks`` (the cluster's, of
        ``capacity_blocks`` in all) cover them and every older claim that still holds; else record (or renew)
        its claim and raise.

        Raises:
            CapacityExhausted: older admissions wait for the rBlocks this one would take.
        """
        now = self._clock()
        self._expire(now, capacity_blocks)
        mine = self._claims.get(seq_id)
        since = mine.since if mine is not None else now
        older = [
            c
            for s, c in self._claims.items()
            if s != seq_id and c.since < since and self.holds(c, now) and not (owner and c.owner == owner)
        ]
        need = sum(c.n_blocks for c in older)
        if older and free_blocks - n_blocks < need:
            self.claim(seq_id, n_blocks, owner)
            raise CapacityExhausted(
                f"{len(older)} older admission(s) wait for {need} rBlocks; {free_blocks} are free, and this one "
                f"asks for {n_blocks} (first come, first served across compute instances)"
            )

    def claim(self, seq_id: str, n_blocks: int, owner: str = "") -> None:
        """Record that ``seq_id``'s admission of ``n_blocks`` rBlocks (for compute instance ``owner``) was
        refused; renew it if recorded."""
        now = self._clock()
        mine = self._claims.get(seq_id)
        self._claims[seq_id] = Claim(n_blocks, now if mine is None else mine.since, now, owner)

    def renew(self, owner: str, waiting: Iterable[str]) -> int:
        """A heartbeat of compute instance ``owner`` lists its ``waiting`` sequences with claims: renew those,
        and end its other claims (those renewed within ``UNLISTED_GRACE_S`` stay). Returns how many ended (a
        lapsed claim is dropped, not counted)."""
        now, listed, ended = self._clock(), set(waiting), 0
        for seq_id, c in list(self._claims.items()):
            if c.owner != owner:
                continue
            if now - c.renewed > self.ttl_s:  # lapsed already: not brought back (its turn is gone)
                del self._claims[seq_id]
            elif seq_id in listed:
                c.renewed = now
            elif now - c.renewed > UNLISTED_GRACE_S:
                del self._claims[seq_id]
                ended += 1
        return ended

    def holds(self, claim: Claim, now: float | None = None) -> bool:
        """Whether ``claim`` still holds later admissions back (for ``hold_s`` after it was made)."""
        return (self._clock() if now is None else now) - claim.since < self.hold_s

    def now(self) -> float:
        """This object's clock (``time.monotonic()`` unless a test gave another)."""
        return self._clock()

    def drop(self, seq_id: str) -> None:
        """``seq_id`` was admitted: its claim ends (no-op without one)."""
        self._claims.pop(seq_id, None)

    def drop_owner(self, owner: str) -> None:
        """Compute instance ``owner`` left (deregistered): its claims end."""
        for seq_id in [s for s, c in self._claims.items() if c.owner == owner]:
            del self._claims[seq_id]

    def reset(self) -> None:
        """Forget every claim (a new leading term: claims are the leader's soft state)."""
        self._claims.clear()

    def waiting(self) -> list[tuple[str, Claim]]:
        """The claims not lapsed, oldest first. Safe from another thread (a metrics scrape)."""
        now = self._clock()
        claims = [(s, c) for s, c in list(self._claims.items()) if now - c.renewed <= self.ttl_s]
        return sorted(claims, key=lambda kv: kv[1].since)

    def _expire(self, now: float, capacity_blocks: int) -> None:
        for seq_id, c in list(self._claims.items()):
            if now - c.renewed > self.ttl_s or c.n_blocks > capacity_blocks:
                del self._claims[seq_id]
