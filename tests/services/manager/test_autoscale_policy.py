"""The elastic pool's scaling policy as an executable spec: exact decisions for observations over time."""

from __future__ import annotations

import pytest

from infinite_llm.services.manager.autoscale import (
    Action,
    Decision,
    PoolObservation,
    ScalingConfig,
    ScalingPolicy,
    ServerLoad,
)

# Thresholds 10% / 60% free, 30 s of pressure to add, 300 s of surplus to drain, 120 s cool-down.
CONFIG = ScalingConfig(
    min_replicas=1,
    max_replicas=4,
    scale_up_below=0.10,
    scale_down_above=0.60,
    scale_up_after_s=30,
    scale_down_after_s=300,
    cooldown_s=120,
)


def pool(*free: int, capacity: int = 100, held: dict[int, int] | None = None, replicas: int | None = None):
    """Servers 0..n-1 of ``capacity`` rBlocks with ``free[i]`` free; held defaults to what is used."""
    held = held or {}
    servers = {i: ServerLoad(capacity, f, held.get(i, capacity - f)) for i, f in enumerate(free)}
    return PoolObservation(len(free) if replicas is None else replicas, servers)


def run(policy: ScalingPolicy, observations, start: float = 0.0, step: float = 5.0) -> list[Decision]:
    """Feed observations every ``step`` seconds, committing every decision (as the controller does)."""
    decisions = []
    for i, obs in enumerate(observations):
        now = start + i * step
        d = policy.decide(obs, now)
        policy.commit(d, now)
        decisions.append(d)
    return decisions


def actions(decisions):
    return [(d.action, d.replicas, d.ordinal) for d in decisions if d.action is not Action.HOLD]


def test_scales_up_once_pressure_lasts_the_whole_window():
    policy = ScalingPolicy(CONFIG)
    low = pool(5, 8)  # 13 of 200 free: 6.5%
    for t in (0, 10, 20, 29.9):
        assert policy.decide(low, t).action is Action.HOLD
    d = policy.decide(low, 30)
    assert d == Decision(Action.SCALE_UP, 3, None, "6% free for 30 s")
    policy.commit(d, 30)
    # The new server has not registered yet, and the pool is cooling down: no second scale-up.
    assert policy.decide(pool(5, 8, replicas=3), 35).reason.startswith("cooling down for 115 s")


def test_no_second_scale_up_until_the_new_server_registers():
    policy = ScalingPolicy(CONFIG)
    run(policy, [pool(5, 8)] * 7)  # t=0..30: scaled to 3
    still_missing = pool(5, 8, replicas=3)
    decisions = run(policy, [still_missing] * 60, start=35)  # pressure way past cool-down + window
    assert actions(decisions) == []
    assert decisions[-1].reason == "waiting for servers [2] to register"
    registered = pool(5, 8, 4)  # server 2 arrived but is almost full too (17 of 300 free)
    assert actions(run(policy, [registered] * 7, start=340)) == [(Action.SCALE_UP, 4, None)]


def test_pressure_that_relents_inside_the_window_adds_nothing():
    policy = ScalingPolicy(CONFIG)
    series = [pool(5, 5)] * 5 + [pool(20, 20)] + [pool(5, 5)] * 5  # 25 s low, 5 s at 20%, 25 s low
    assert actions(run(policy, series)) == []


def test_oscillating_load_never_flaps():
    """Load swinging across both thresholds faster than the windows moves nothing, for an hour."""
    policy = ScalingPolicy(CONFIG)
    swing = [pool(3, 4, 5), pool(3, 4, 5), pool(90, 95, 99), pool(90, 95, 99)] * 180  # 20 s period, 3600 s
    decisions = run(policy, swing)
    assert actions(decisions) == [] and len(decisions) == 720
    # Between the thresholds (30% free) nothing happens either, however long.
    assert actions(run(ScalingPolicy(CONFIG), [pool(30, 30, 30)] * 720)) == []


def test_surplus_drains_the_highest_ordinal_and_scales_down_only_when_it_is_empty():
    policy = ScalingPolicy(CONFIG)
    idle = pool(90, 90, 60, held={0: 10, 1: 10, 2: 40})  # 80% free; without server 2: 90%
    decisions = run(policy, [idle] * 61)  # 0..300 s
    assert actions(decisions) == [(Action.DRAIN, 3, 2)]
    assert decisions[-1].reason == "80% free for 300 s" and policy.draining == 2
    # Server 2 still holds rBlocks: wait, however long it takes.
    draining = run(policy, [pool(90, 90, 70, held={0: 10, 1: 10, 2: 30})] * 100, start=305)
    assert actions(draining) == [] and draining[-1].reason == "draining server 2: 30 rBlocks left"
    assert draining[-1].ordinal == 2
    # Its last sequence released its rBlocks: now, and only now, remove it.
    empty = pool(90, 90, 100, held={0: 10, 1: 10, 2: 0})
    d = policy.decide(empty, 900)
    assert d == Decision(Action.SCALE_DOWN, 2, 2, "server 2 drained")
    policy.commit(d, 900)
    assert policy.draining is None


def test_reservations_in_flight_keep_a_drained_server():
    policy = ScalingPolicy(CONFIG)
    run(policy, [pool(90, 90, 60, held={0: 10, 1: 10, 2: 40})] * 61)
    in_flight = pool(90, 90, 100, held={0: 10, 1: 10, 2: 1})  # free says empty, a reservation is in flight
    assert policy.decide(in_flight, 310).action is Action.HOLD


def test_drain_is_cancelled_when_pressure_returns():
    policy = ScalingPolicy(CONFIG)
    run(policy, [pool(90, 90, 60, held={2: 40})] * 61)
    assert policy.draining == 2
    busy = pool(5, 4, 50, held={2: 50})  # the two other servers are nearly full (4.5% free)
    d = policy.decide(busy, 310)
    assert d == Decision(Action.CANCEL_DRAIN, 3, 2, "pressure returned (4% free)")
    policy.commit(d, 310)
    assert policy.draining is None
    # Server 2 is back in the pool (59 of 300 free: no pressure), and the cancellation starts a cool-down.
    decisions = run(policy, [busy] * 30, start=315)
    assert actions(decisions) == []
    assert decisions[0].reason == "cooling down for 115 s" and decisions[-1].reason == "20% free"


def test_scale_down_refused_when_the_rest_would_be_short():
    """75% free overall, but without server 2 only 30% would be: removing it would invite a scale-up."""
    policy = ScalingPolicy(CONFIG)
    lopsided = PoolObservation(3, {0: ServerLoad(100, 30, 70), 1: ServerLoad(100, 30, 70), 2: ServerLoad(400, 400, 0)})
    decisions = run(policy, [lopsided] * 70)
    assert actions(decisions) == []
    assert decisions[-1].reason == "without server 2 the pool would have 30% free"


def test_never_above_max_replicas():
    policy = ScalingPolicy(CONFIG)
    full = pool(0, 0, 0, 0)
    decisions = run(policy, [full] * 100)
    assert actions(decisions) == []
    assert decisions[-1].reason == "under pressure but at max_replicas=4"


def test_never_below_min_replicas():
    policy = ScalingPolicy(ScalingConfig(min_replicas=2, max_replicas=4, scale_down_after_s=60, cooldown_s=0))
    decisions = run(policy, [pool(100, 100)] * 100)
    assert actions(decisions) == []
    assert decisions[-1].reason == "surplus but at min_replicas=2"


def test_out_of_bounds_replicas_are_corrected():
    policy = ScalingPolicy(ScalingConfig(min_replicas=2, max_replicas=3))
    # Below min: straight up to min, without waiting for a window or a cool-down.
    d = policy.decide(pool(50), 0)
    assert d == Decision(Action.SCALE_UP, 2, None, "below min_replicas=2")
    policy.commit(d, 0)
    # Above max (someone scaled by hand): drain the top server even under pressure, then remove it.
    over = pool(5, 5, 5, 5)
    assert actions(run(policy, [over], start=1)) == [(Action.DRAIN, 4, 3)]
    assert policy.decide(over, 2).action is Action.HOLD  # still holds rBlocks; pressure does not cancel
    d = policy.decide(pool(5, 5, 5, 100, held={3: 0}), 3)
    assert d == Decision(Action.SCALE_DOWN, 3, 3, "server 3 drained")


def test_drain_target_removed_by_someone_else_is_forgotten():
    policy = ScalingPolicy(CONFIG)
    run(policy, [pool(90, 90, 60, held={2: 40})] * 61)
    d = policy.decide(pool(90, 90), 310)
    assert d == Decision(Action.CANCEL_DRAIN, 2, 2, "server 2 was removed by someone else")


def test_a_decision_not_applied_is_decided_again():
    """The controller commits only what it applied: a failed Kubernetes call repeats on the next tick."""
    policy = ScalingPolicy(CONFIG)
    low = pool(5, 8)
    for t in range(0, 31, 5):
        d = policy.decide(low, t)
    assert d.action is Action.SCALE_UP
    assert policy.decide(low, 35) == Decision(Action.SCALE_UP, 3, None, "6% free for 30 s")  # not committed


def test_no_capacity_reported_is_not_pressure():
    policy = ScalingPolicy(CONFIG)
    decisions = run(policy, [PoolObservation(1, {})] * 100)
    assert actions(decisions) == [] and decisions[-1].reason == "free fraction unknown"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_replicas": 0}, "min_replicas must be >= 1, got 0"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) must be >= min_replicas (3)"),
        ({"scale_up_below": 0.6, "scale_down_above": 0.6}, "0 <= scale_up_below < scale_down_above <= 1"),
        ({"scale_down_above": 1.5}, "scale_down_above=1.5"),
        ({"cooldown_s": -1}, "cooldown_s must be a finite number of seconds >= 0, got -1"),
        ({"scale_up_after_s": float("nan")}, "scale_up_after_s must be a finite number"),
    ],
)
def test_bad_config_is_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScalingConfig(**kwargs)
