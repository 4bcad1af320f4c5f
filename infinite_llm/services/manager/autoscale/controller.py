"""The autoscaler loop: observe the pool, ask the policy, apply its decision with Kubernetes and the guard.

Every ``interval_s`` seconds, on the leading manager only: read the StatefulSet's replicas
(:mod:`.k8s_client`), the manager's cluster state (capacity view + ledger), turn them into a
:class:`PoolObservation` (:func:`observe`), let :class:`ScalingPolicy` decide, apply the decision (scale
the StatefulSet, or start/stop draining a server through :class:`DrainGuard`), then commit it to the policy.
Attention servers are the StatefulSet's pods, so a server's id is its pod name, ``<statefulset>-<ordinal>``.
The drain state lives in this process: a manager that takes over leadership starts with no drain.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from infinite_llm.services.manager.autoscale.k8s_client import StatefulSetScaler
from infinite_llm.services.manager.autoscale.policy import (
    Action,
    Decision,
    PoolObservation,
    ScalingConfig,
    ScalingPolicy,
    ServerLoad,
)
from infinite_llm.services.manager.drain import DrainGuard
from infinite_llm.services.manager.manager import GlobalManager
from infinite_llm.services.manager.records import ClusterState, blocks_per_server
from infinite_llm.services.periodic import PeriodicTask

log = logging.getLogger(__name__)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class AutoscaleSettings:
    """Which StatefulSet (``namespace`` "" = the pod's own), the policy, and the loop period (seconds)."""

    statefulset: str
    namespace: str = ""
    policy: ScalingConfig = field(default_factory=ScalingConfig)
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.statefulset) or len(self.statefulset) > 52:
            raise ValueError(f"statefulset must be a DNS label of at most 52 characters, got {self.statefulset!r}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


def ordinal_of(server_id: str, statefulset: str) -> int | None:
    """``attention-3`` -> 3 for StatefulSet ``attention``; None for an id that is not one of its pods."""
    prefix = statefulset + "-"
    tail = server_id[len(prefix) :]
    if not server_id.startswith(prefix) or not tail.isdigit() or (tail != "0" and tail.startswith("0")):
        return None
    return int(tail)


def observe(state: ClusterState, replicas: int, statefulset: str, in_flight: Callable[[str], int]) -> PoolObservation:
    """The policy's view: every registered attention server of ``statefulset``, by ordinal.

    ``held_blocks`` counts what the ledger places on the server plus reservations ``in_flight`` on it.
    """
    placed = blocks_per_server(state.ledger)
    servers = {}
    for m in state.members:
        ordinal = ordinal_of(m.info.server_id, statefulset)
        if ordinal is None or m.info.kind != "attention":
            continue
        sid = m.info.server_id
        servers[ordinal] = ServerLoad(m.info.capacity_blocks, m.free_blocks, placed.get(sid, 0) + in_flight(sid))
    return PoolObservation(replicas, servers)


def draining_servers(
    statefulset: str, draining: int | None, replicas: int, member_ids: Iterable[str]
) -> frozenset[str]:
    """Servers placement must avoid: the one being drained, and members whose pods are being removed."""
    out = {f"{statefulset}-{draining}"} if draining is not None else set()
    for sid in member_ids:
        ordinal = ordinal_of(sid, statefulset)
        if ordinal is not None and ordinal >= replicas:
            out.add(sid)
    return frozenset(out)


class Autoscaler:
    """Runs the policy against one StatefulSet for one manager. ``clock``: monotonic seconds."""

    def __init__(
        self,
        manager: GlobalManager,
        guard: DrainGuard,
        scaler: StatefulSetScaler,
        settings: AutoscaleSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager, self.guard, self.scaler, self.settings = manager, guard, scaler, settings
        self.policy = ScalingPolicy(settings.policy)
        self._clock = clock
        self._loop = PeriodicTask("attention-autoscaler", self.tick, self.settings.interval_s, tick_first=True)
        self._last_reason = ""

    async def tick(self) -> Decision | None:
        """One round; returns the decision applied (None on a follower, which never scales).

        Raises:
            Unavailable: the Kubernetes API or etcd failed; nothing was committed (the next tick retries).
        """
        if not self.manager.is_leader:
            return None
        replicas = await asyncio.to_thread(self.scaler.get_replicas)
        # Count reservations in flight before reading the ledger: a placement writes the ledger before it
        # commits (and leaves this count), so every rBlock shows in one or the other.
        in_flight = self.guard.in_flight_counts()
        state = await self.manager.cluster_state()
        now = self._clock()
        obs = observe(state, replicas, self.settings.statefulset, lambda sid: in_flight.get(sid, 0))
        decision = self.policy.decide(obs, now)
        if decision.action in (Action.SCALE_UP, Action.SCALE_DOWN):
            await asyncio.to_thread(self.scaler.set_replicas, decision.replicas)
        self.policy.commit(decision, now)
        members = [m.info.server_id for m in state.members]
        self.guard.set_draining(
            draining_servers(self.settings.statefulset, self.policy.draining, decision.replicas, members)
        )
        self._log(decision)
        return decision

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def _log(self, decision: Decision) -> None:
        if decision.action is not Action.HOLD:
            log.info("autoscaler: %s -> %d replicas (%s)", decision.action, decision.replicas, decision.reason)
        elif decision.reason != self._last_reason:
            log.debug("autoscaler: hold (%s)", decision.reason)
        self._last_reason = decision.reason
