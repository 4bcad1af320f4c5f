"""The simulator's hands on the real planner: build its view, run :func:`plan`, carry out the moves.

Every ``planner_interval_s`` of simulated time (DESIGN.md §9, PAPER.md "Cluster scheduling"): heartbeat the
manager's :class:`CapacityView` with each server's true free count; fit each instance's :class:`StepCost`
from its own decode-step timings (:func:`fit_step_cost`, the instance's roofline coefficients as the prior);
build a :class:`ClusterView`; run :func:`plan`; keep the view as its moves leave it, for :func:`lenders`
(where placement may borrow until the next run); and start each move as the manager does: reserve on the
destination (a refusal drops the move), transfer at ``migration_tokens_per_step`` tokens per step of the
owning instance, then flip (commit on the destination, release on the source). A sequence that finishes
mid-transfer cancels the reservation: nothing leaks.

The view carries only the sequences :func:`plan` can act on: per instance its longest sequence with rBlocks
at home (what lending moves), and every sequence with rBlocks away from its owner's home (what makes an
owner a borrower, and what bringing home moves). Sequences wholly at home and shorter than that one change
no decision and would make each run cost O(sequences) per server looked at.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.services.manager.planner import (
    ClusterView,
    InstanceView,
    Move,
    PlannerConfig,
    SeqView,
    ServerView,
    StepCost,
    apply_moves,
    fit_step_cost,
    lenders,
    plan,
)
from infinite_llm.sim.cluster import SimSeq

if TYPE_CHECKING:
    from infinite_llm.sim.simulator import Simulator


class PlannerDriver:
    """Runs the real planner over a :class:`~infinite_llm.sim.simulator.Simulator` and applies its moves."""

    def __init__(self, sim: Simulator, config: PlannerConfig | None = None) -> None:
        self.sim = sim
        self.config = config or PlannerConfig()
        cost = sim.config.cost
        self.prior = StepCost(cost.fixed_s + cost.weights_s, cost.seq_s, cost.kv_token_s)
        self.migrations = 0
        self.migrated_blocks = 0
        self._after: ClusterView | None = None
        self._lenders: dict[str, tuple[str, ...]] = {}

    @property
    def stats(self) -> tuple[int, int]:
        return self.migrations, self.migrated_blocks

    async def tick(self, now: float) -> None:
        sim = self.sim
        for server_id, free in sim.servers.free_blocks.items():
            sim.view.heartbeat(server_id, free, load=0.0, now=now)
        view = self.cluster_view()
        moves = plan(view, self.config)
        self._after, self._lenders = apply_moves(view, moves), {}
        for move in moves:
            self._start(move, now)

    def lenders_of(self, instance_id: str) -> tuple[str, ...]:
        """Where ``instance_id`` may borrow until the next run: the planner's :func:`lenders` on the view as
        its moves leave it (computed when first asked: only instances whose home is full ask)."""
        if instance_id not in self._lenders:
            self._lenders[instance_id] = lenders(self._after, instance_id)
        return self._lenders[instance_id]

    def cluster_view(self) -> ClusterView:
        sim = self.sim
        servers = tuple(
            ServerView(s, sim.servers.capacity[s], sim.servers.free_blocks[s]) for s in sorted(sim.servers.capacity)
        )
        instances = tuple(
            InstanceView(
                i.instance_id,
                (i.home,),
                num_running=len(i.running),
                num_waiting=len(i.queue),
                num_tokens_held=sum(s.computed for s in i.running),
                cost=fit_step_cost(list(i.samples), self.prior),
            )
            for i in sim.instances
        )
        return ClusterView(servers, instances, tuple(self._seq_views()), sim.config.block_size)

    def _seq_views(self) -> list[SeqView]:
        sim, out = self.sim, []
        for inst in sim.instances:
            at_home = [s for s in inst.running if s.blocks.get(inst.home, 0)]
            longest = min(at_home, key=lambda s: (-s.num_blocks, s.seq_id), default=None)
            for s in inst.running:
                if s is longest or any(server != inst.home for server in s.blocks):
                    out.append(SeqView(s.seq_id, inst.instance_id, tuple(sorted(s.blocks.items()))))
        return out

    def _start(self, move: Move, now: float) -> None:
        """Reserve on the destination, then schedule the flip after the metered transfer."""
        sim = self.sim
        seq = sim.seqs.get(move.seq_id)
        if seq is None or seq.migrating or seq.blocks.get(move.src, 0) < move.n_blocks:
            return
        try:
            reservation = sim.servers.reserve_now(move.dst, move.seq_id, move.n_blocks)
        except CapacityExhausted:
            sim.view.mark_stale(move.dst)
            return
        sim.view.take(move.dst, move.n_blocks)
        seq.migrating = True
        owner = sim.instances[seq.owner]
        steps = math.ceil(move.n_blocks * sim.config.block_size / sim.config.migration_tokens_per_step)
        done_at = now + steps * max(owner.last_step_s, 1e-6)
        sim.schedule(done_at, "migrated", (move, reservation.reservation_id, seq))

    def finish(self, payload: tuple[Move, int, SimSeq]) -> None:
        """The transfer ended: flip the sequence's placement, or cancel if it finished meanwhile."""
        move, reservation_id, seq = payload
        sim = self.sim
        seq.migrating = False
        if seq.blocks.get(move.src, 0) < move.n_blocks:  # finished (its rBlocks freed) during the transfer
            sim.servers.cancel_now(move.dst, reservation_id)
            sim.view.give_back(move.dst, move.n_blocks)
            return
        sim.kv.add(seq, -seq.computed)
        seq.blocks[move.src] -= move.n_blocks
        if seq.blocks[move.src] == 0:
            del seq.blocks[move.src]
        seq.blocks[move.dst] = seq.blocks.get(move.dst, 0) + move.n_blocks
        sim.kv.add(seq, seq.computed)
        sim.servers.commit_now(move.dst, reservation_id)
        sim.servers.release(move.src, move.seq_id, move.n_blocks)
        sim.view.give_back(move.src, move.n_blocks)
        self.migrations += 1
        self.migrated_blocks += move.n_blocks
