"""The elastic attention pool's scaling policy: when to add an attention server, when to drain one away.

Pure code (standard library only): it sees a :class:`PoolObservation` (the StatefulSet's replicas and, per
registered server ordinal, its capacity, free and held rBlocks) and a monotonic time, and answers with a
:class:`Decision`. The controller (:mod:`.controller`) gathers observations and applies decisions; the
policy changes its own state only in :meth:`ScalingPolicy.commit`, called once a decision was applied
(query, then commit, as the block pool's ``reserve``/``commit``), so a failed Kubernetes call is simply
decided again on the next tick.

Rules, in order (PAPER.md "Managers": the pool grows when debtors cannot find creditors):

- replicas below ``min_replicas``: scale up to it at once; above ``max_replicas``: drain the top server.
- while draining server ``d`` (always the highest ordinal: a StatefulSet removes that pod first): cancel
  the drain if the other servers are under pressure, scale down to ``d`` replicas once ``d`` holds no
  rBlocks, else wait.
- within ``cooldown_s`` of the last change: hold.
- free fraction below ``scale_up_below`` for ``scale_up_after_s``: one more server (up to ``max_replicas``,
  and only once every current replica has registered, so capacity on its way is not ordered twice).
- free fraction above ``scale_down_above`` for ``scale_down_after_s``: drain the top server, unless the
  pool without it would be less than halfway between the two thresholds (so the scale-down itself
  cannot cause a scale-up).

The free fraction is free rBlocks / capacity over the registered servers below ``replicas``, without the
server being drained (placement no longer uses it). Two thresholds and two durations are the hysteresis:
a load that swings across a threshold faster than the duration never moves the pool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class ScalingConfig:
    """Bounds, thresholds (fractions of the pool's rBlocks that are free) and durations (seconds)."""

    min_replicas: int = 1
    max_replicas: int = 8
    scale_up_below: float = 0.10
    scale_down_above: float = 0.60
    scale_up_after_s: float = 30.0
    scale_down_after_s: float = 300.0
    cooldown_s: float = 120.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if not 0.0 <= self.scale_up_below < self.scale_down_above <= 1.0:
            raise ValueError(
                "thresholds must satisfy 0 <= scale_up_below < scale_down_above <= 1, got "
                f"scale_up_below={self.scale_up_below}, scale_down_above={self.scale_down_above}"
            )
        for name in ("scale_up_after_s", "scale_down_after_s", "cooldown_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")

    @property
    def scale_down_floor(self) -> float:
        """Free fraction the pool must keep after losing a server: halfway between the thresholds."""
        return (self.scale_up_below + self.scale_down_above) / 2


@dataclass(frozen=True)
class ServerLoad:
    """One registered attention server, in rBlocks. ``held_blocks``: placed on it (ledger + in flight)."""

    capacity_blocks: int
    free_blocks: int
    held_blocks: int


@dataclass(frozen=True)
class PoolObservation:
    """``replicas``: the StatefulSet's desired replicas; ``servers``: registered servers by pod ordinal."""

    replicas: int
    servers: Mapping[int, ServerLoad]


class Action(StrEnum):
    HOLD = "hold"
    SCALE_UP = "scale-up"
    DRAIN = "drain"  # stop placing on ``ordinal``; scale down once it holds no rBlocks
    CANCEL_DRAIN = "cancel-drain"
    SCALE_DOWN = "scale-down"


@dataclass(frozen=True)
class Decision:
    """What to do: ``replicas`` is the StatefulSet's replicas after it; ``ordinal`` the server concerned."""

    action: Action
    replicas: int
    ordinal: int | None = None
    reason: str = ""


class ScalingPolicy:
    """Decides from observations; remembers the server being drained, the last change, pressure timers."""

    def __init__(self, config: ScalingConfig) -> None:
        self.config = config
        self.draining: int | None = None
        self._last_change: float | None = None
        self._low_since: float | None = None  # free fraction below scale_up_below since (monotonic s)
        self._high_since: float | None = None  # free fraction above scale_down_above since

    def decide(self, obs: PoolObservation, now: float) -> Decision:
        """The decision for ``obs`` at monotonic time ``now`` (seconds). Only pressure timers change here."""
        c = self.config
        frac = self._track(obs, now)
        hold = Decision(Action.HOLD, obs.replicas)
        if self.draining is not None:
            return self._while_draining(obs, frac)
        if obs.replicas < c.min_replicas:
            return Decision(Action.SCALE_UP, c.min_replicas, reason=f"below min_replicas={c.min_replicas}")
        if obs.replicas > c.max_replicas:
            return Decision(Action.DRAIN, obs.replicas, obs.replicas - 1, f"above max_replicas={c.max_replicas}")
        if self._last_change is not None and now - self._last_change < c.cooldown_s:
            return _with(hold, f"cooling down for {c.cooldown_s - (now - self._last_change):.0f} s")
        if _held_for(self._low_since, c.scale_up_after_s, now):
            return self._scale_up(obs, frac)
        if _held_for(self._high_since, c.scale_down_after_s, now):
            return self._drain_top(obs, frac)
        return _with(hold, "free fraction unknown" if frac is None else f"{frac:.0%} free")

    def commit(self, decision: Decision, now: float) -> None:
        """Record that ``decision`` was applied at ``now``."""
        if decision.action is Action.HOLD:
            return
        if decision.action is Action.DRAIN:
            assert self.draining is None, f"already draining {self.draining}"
            self.draining = decision.ordinal
            return
        assert decision.action is Action.SCALE_UP or self.draining == decision.ordinal, (decision, self.draining)
        self.draining = None
        self._last_change = now
        self._low_since = self._high_since = None  # the new pool must show its pressure for a full window

    # ---- rules ---------------------------------------------------------------------------------------
    def _while_draining(self, obs: PoolObservation, frac: float | None) -> Decision:
        d = self.draining
        assert d is not None
        if d >= obs.replicas:
            return Decision(Action.CANCEL_DRAIN, obs.replicas, d, f"server {d} was removed by someone else")
        if frac is not None and frac < self.config.scale_up_below and obs.replicas <= self.config.max_replicas:
            return Decision(Action.CANCEL_DRAIN, obs.replicas, d, f"pressure returned ({frac:.0%} free)")
        held = obs.servers[d].held_blocks if d in obs.servers else 0
        if held == 0:
            return Decision(Action.SCALE_DOWN, d, d, f"server {d} drained")
        return Decision(Action.HOLD, obs.replicas, d, f"draining server {d}: {held} rBlocks left")

    def _scale_up(self, obs: PoolObservation, frac: float | None) -> Decision:
        c = self.config
        if obs.replicas >= c.max_replicas:
            return Decision(Action.HOLD, obs.replicas, reason=f"under pressure but at max_replicas={c.max_replicas}")
        missing = [i for i in range(obs.replicas) if i not in obs.servers]
        if missing:
            return Decision(Action.HOLD, obs.replicas, reason=f"waiting for servers {missing} to register")
        return Decision(Action.SCALE_UP, obs.replicas + 1, reason=f"{frac:.0%} free for {c.scale_up_after_s:.0f} s")

    def _drain_top(self, obs: PoolObservation, frac: float | None) -> Decision:
        c = self.config
        if obs.replicas <= c.min_replicas:
            return Decision(Action.HOLD, obs.replicas, reason=f"surplus but at min_replicas={c.min_replicas}")
        top = obs.replicas - 1
        after = _free_fraction(obs, exclude=top)
        if after is None or after < c.scale_down_floor:
            shown = "no capacity" if after is None else f"{after:.0%} free"
            return Decision(Action.HOLD, obs.replicas, reason=f"without server {top} the pool would have {shown}")
        return Decision(Action.DRAIN, obs.replicas, top, f"{frac:.0%} free for {c.scale_down_after_s:.0f} s")

    def _track(self, obs: PoolObservation, now: float) -> float | None:
        """Update the pressure timers; returns the free fraction (None: no capacity registered)."""
        frac = _free_fraction(obs, exclude=self.draining)
        low = frac is not None and frac < self.config.scale_up_below
        high = frac is not None and frac > self.config.scale_down_above
        self._low_since = (self._low_since if self._low_since is not None else now) if low else None
        self._high_since = (self._high_since if self._high_since is not None else now) if high else None
        return frac


def _free_fraction(obs: PoolObservation, exclude: int | None) -> float | None:
    """Free rBlocks / capacity over registered servers below ``replicas`` other than ``exclude``."""
    usable = [s for i, s in obs.servers.items() if i < obs.replicas and i != exclude]
    capacity = sum(s.capacity_blocks for s in usable)
    if capacity == 0:
        return None
    return sum(min(s.free_blocks, s.capacity_blocks) for s in usable) / capacity


def _held_for(since: float | None, duration_s: float, now: float) -> bool:
    return since is not None and now - since >= duration_s


def _with(decision: Decision, reason: str) -> Decision:
    return Decision(decision.action, decision.replicas, decision.ordinal, reason)
