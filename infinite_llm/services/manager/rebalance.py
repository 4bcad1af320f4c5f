"""The planner in the leading manager: build its :class:`~.planner.ClusterView`, run it, start the moves.

:class:`Rebalancer` turns the manager's state (live attention servers and their free rBlocks from the
capacity view, draining servers from the manager's drain guard (scaled down, or stopping on their own),
compute instances with their homes, loads and fitted step costs, the ledger's sequences and owners) into
the planner's pure input, and starts each planned move through :class:`~.migrations.Migrations`. Only
sequences whose owner is a live compute instance move (the owner flips its block table); one migration per
sequence at a time, and none for a while after one that moved nothing (``Migrations.backing_off``: the
sequence was preempted or finished).
"""

from __future__ import annotations

import logging
from collections import deque

from infinite_llm.services.manager.planner import (
    ClusterView,
    InstanceView,
    PlannerConfig,
    SeqView,
    ServerView,
    StepSample,
    fit_step_cost,
    lenders,
    plan,
)
from infinite_llm.services.periodic import PeriodicTask

log = logging.getLogger(__name__)
SAMPLES_KEPT = 64  # step-timing heartbeats kept per instance for the cost fit
PLAN_INTERVAL_S = 2.0  # how often the leading manager plans (seconds): about a compute heartbeat's period


class Rebalancer:
    """Periodic planning for a :class:`~.manager.GlobalManager` (``manager``); see the module docstring."""

    def __init__(self, manager, config: PlannerConfig | None = None) -> None:  # noqa: ANN001
        self.manager = manager
        self.config = config or PlannerConfig()
        self._samples: dict[str, deque[StepSample]] = {}
        self._loop: PeriodicTask | None = None

    def observe_steps(self, instance_id: str, batch: int, tokens: int, num_steps: int, mean_step_s: float) -> None:
        """One heartbeat's step timing (``num_steps`` decode steps of ``mean_step_s`` seconds on average)."""
        if num_steps > 0 and mean_step_s > 0 and batch > 0:
            self._samples.setdefault(instance_id, deque(maxlen=SAMPLES_KEPT)).append(
                StepSample(batch, tokens, mean_step_s)
            )

    def draining(self) -> frozenset[str]:
        return self.manager.drains.draining

    async def cluster_view(self) -> ClusterView:
        """The planner's input, read now (the ledger from etcd, the rest from memory). Migrations in flight
        count as done (the ledger already says so; their sources' rBlocks count as free)."""
        m = self.manager
        draining = self.draining()
        leaving: dict[str, int] = {}  # rBlocks migrations in flight will free on their sources
        for order in m.migrations.in_flight.values():
            leaving[order.src] = leaving.get(order.src, 0) + len(order.reservation_ids)
        servers = []
        for member in m.members():
            cap = m.view.get(member.info.server_id)
            if cap is not None:
                free = (
                    0
                    if cap.stale
                    else min(cap.free_blocks + leaving.get(member.info.server_id, 0), cap.capacity_blocks)
                )
                servers.append(
                    ServerView(member.info.server_id, cap.capacity_blocks, free, member.info.server_id in draining)
                )
        instances = tuple(
            InstanceView(
                c.info.instance_id,
                c.homes,
                c.load.num_running,
                c.load.num_waiting,
                c.load.num_tokens_held,
                fit_step_cost(list(self._samples.get(c.info.instance_id, ()))),
            )
            for c in m.computes.states(x.info for x in m.members())
        )
        records = await m.ledger.read_records()
        seqs = tuple(SeqView(r.seq_id, r.owner, tuple((s, n) for s, n in r.entries if n > 0)) for r in records)
        return ClusterView(tuple(servers), instances, seqs, m.config.block_size)

    async def placement_targets(self, owner: str, n_blocks: int) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        """``(homes, lenders)`` for a placement of ``owner``: its homes, and only when they cannot hold
        ``n_blocks`` the servers the planner lets it borrow from (``None``: an unknown owner, any server)."""
        m = self.manager
        states = {c.info.instance_id: c for c in m.computes.states(x.info for x in m.members())}
        if owner not in states:
            return (), None
        homes = states[owner].homes
        if sum(m.view.free_blocks().get(h, 0) for h in homes) >= n_blocks:
            return homes, None
        return homes, lenders(await self.cluster_view(), owner)

    async def tick(self) -> int:
        """Plan once and start the moves that can start; returns how many started."""
        if not self.manager.is_leader:
            return 0
        await self.manager.migrations.expire()
        view = await self.cluster_view()
        owners = {s.seq_id: s.owner for s in view.seqs}
        live = {i.instance_id for i in view.instances}
        started, migrations = 0, self.manager.migrations
        for move in plan(view, self.config):
            owner = owners.get(move.seq_id, "")
            if owner not in live or migrations.busy(move.seq_id) or migrations.backing_off(move.seq_id):
                continue
            if await migrations.start(move, owner) is not None:
                started += 1
        return started

    def start(self, interval_s: float) -> None:
        """Run :meth:`tick` every ``interval_s`` seconds in the background (errors are logged, not raised)."""
        self._loop = PeriodicTask("planner", self.tick, interval_s)
        self._loop.start()

    async def stop(self) -> None:
        if self._loop is not None:
            await self._loop.stop()
            self._loop = None
