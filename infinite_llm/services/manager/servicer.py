"""GlobalManager servicer: thin async handlers over :class:`GlobalManager` (typed errors map to statuses)."""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry

from infinite_llm.core.errors import CapacityExhausted, PermissionDenied
from infinite_llm.observability.metrics import ManagerMetrics
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.kv_layout import kv_layout_of
from infinite_llm.rpc.tls import peer_of
from infinite_llm.services.manager.computes import ComputeInfo, ComputeLoad, ComputeState, heartbeat_age_s
from infinite_llm.services.manager.manager import GlobalManager
from infinite_llm.services.manager.membership import check_caller_address
from infinite_llm.services.manager.migrations import MigrationResult
from infinite_llm.services.manager.reconcile import Reports, ServerReport


class GlobalManagerServicer(mgrpc.GlobalManagerServicer):
    def __init__(
        self, manager: GlobalManager, metrics: ManagerMetrics | None = None, reports: Reports | None = None
    ) -> None:
        """``reports``: where heartbeats' holdings go for the orphan reconciler (``None``: dropped)."""
        self.manager = manager
        self.metrics = metrics or ManagerMetrics(CollectorRegistry())
        self.metrics.kv_cache_usage.set_function(self.kv_cache_usage)
        self.metrics.leader.set_function(lambda: float(manager.is_leader))
        self.metrics.admission_claims.set_function(lambda: float(len(manager.admissions.waiting())))
        self.metrics.admission_claimed_rblocks.set_function(
            lambda: float(sum(c.n_blocks for _, c in manager.admissions.waiting()))
        )  # a scrape's thread only reads (admission_claims() may reset them, on the event loop)
        manager.refusals.on_note = lambda kind: self.metrics.registrations_refused.labels(kind=kind).inc()
        self.reports = reports
        self._last_usage = 0.0

    def kv_cache_usage(self) -> float:
        """Used fraction of the live attention servers' rBlocks in the manager's view (0 with none). Read by
        the metrics thread: a view that changes while it is summed gives the last value instead."""
        try:
            caps = [self.manager.view.get(m.info.server_id) for m in self.manager.members()]
            total = sum(c.capacity_blocks for c in caps if c is not None)
            free = sum(c.free_blocks for c in caps if c is not None)
        except RuntimeError:  # changed size during iteration
            return self._last_usage
        self._last_usage = (total - free) / total if total else 0.0
        return self._last_usage

    def address_of(self, server_id: str) -> str | None:
        for m in self.manager.members():
            if m.info.server_id == server_id:
                return m.info.address
        return None

    async def Register(self, request: mpb.RegisterRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        reg = await self.manager.register(
            request.server_id,
            request.address,
            request.capacity_blocks,
            request.block_size,
            request.kind or "attention",
            node_name=request.node_name,
            identity=peer_of(context).identity,
            kv_layout=kv_layout_of(request.layout),
        )
        self.metrics.view_capacity.labels(server_id=request.server_id).set(request.capacity_blocks)
        return mpb.RegisterResponse(lease_ttl_s=reg.ttl_s)

    async def Heartbeat(self, request: mpb.HeartbeatRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self._check_registrant(request.server_id, request.address, context)
        await self.manager.heartbeat(
            request.server_id, request.free_blocks, float(request.num_sequences), draining=request.draining
        )
        if self.reports is not None and request.reports_sequences:
            held = ServerReport(
                {s.seq_id: s.num_blocks for s in request.sequences}, {s.seq_id: s.num_blocks for s in request.reserved}
            )
            self.reports.server(request.server_id, held)
        self.metrics.view_free.labels(server_id=request.server_id).set(request.free_blocks)
        return mpb.HeartbeatResponse()

    async def Deregister(self, request: mpb.DeregisterRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self._check_registrant(request.server_id, request.address, context)
        await self.manager.deregister(request.server_id)
        return mpb.DeregisterResponse()

    def _check_registrant(self, server_id: str, address: str, context: grpc.aio.ServicerContext) -> None:
        """A live server's heartbeats (its capacity, the sequences it reports, a drain) and its deregistration
        come only from the certificate subject that registered it, and, when the caller tells its address
        ('' = an older server: not checked), from the address it registered with: every attention server
        shares one certificate, and a second process under a live id (refused at Register) must not drain
        or remove the live one when it stops. Raises PermissionDenied otherwise."""
        identity = peer_of(context).identity
        live = next((m.info for m in self.manager.members() if m.info.server_id == server_id), None)
        if live is not None and live.identity != identity:
            raise PermissionDenied(
                f"attention server {server_id!r} is registered by another identity", param="server_id"
            )
        if live is not None:
            check_caller_address(f"attention server {server_id!r}", live.address, address, "server_id")

    async def Place(self, request: mpb.PlaceRequest, context: grpc.aio.ServicerContext) -> mpb.PlaceResponse:  # noqa: N802
        if request.block_size:
            self.manager.check_block_size(request.block_size, f"the caller placing {request.seq_id!r}")
        try:
            grants = await self.manager.place(
                request.seq_id,
                request.num_blocks,
                request.near_server_id or None,
                request.first_block_index,
                owner=request.instance_id,
                identity=peer_of(context).identity,
                admission=request.admission,
            )
        except CapacityExhausted:
            self.metrics.placement_failures.inc()
            raise
        self.metrics.placements.inc()
        self.metrics.placed_rblocks.inc(request.num_blocks)
        return mpb.PlaceResponse(
            grants=[
                mpb.BlockGrant(server_id=g.server_id, address=self.address_of(g.server_id) or "", block_ids=g.block_ids)
                for g in grants
            ]
        )

    async def MatchPrefix(self, request: mpb.MatchPrefixRequest, context) -> mpb.MatchPrefixResponse:  # noqa: N802, ANN001
        if request.block_size:
            self.manager.check_block_size(request.block_size, f"the caller matching {request.seq_id!r}")
        prefix = self.manager.prefix
        grants = await prefix.match(
            request.seq_id, list(request.block_hashes), request.instance_id, identity=peer_of(context).identity
        )
        return mpb.MatchPrefixResponse(
            grants=[
                mpb.BlockGrant(server_id=g.server_id, address=self.address_of(g.server_id) or "", block_ids=g.block_ids)
                for g in grants
            ]
        )

    async def PublishPrefix(self, request: mpb.PublishPrefixRequest, context) -> mpb.PublishPrefixResponse:  # noqa: N802, ANN001
        blocks = [(b.seq_id, b.block_index, b.block_hash, b.server_id) for b in request.blocks]
        n = await self.manager.prefix.publish(blocks, identity=peer_of(context).identity)
        return mpb.PublishPrefixResponse(num_indexed=n)

    async def Release(self, request: mpb.ReleaseRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        freed = await self.manager.release(request.seq_id, identity=peer_of(context).identity)
        self.metrics.releases.inc()
        return mpb.ReleaseResponse(num_freed=freed)

    async def GetClusterState(self, request, context) -> mpb.ClusterStateResponse:  # noqa: N802, ANN001
        state = await self.manager.cluster_state()
        cached = self.manager.prefix.blocks_per_server()
        draining = self.manager.drains.draining
        since = self.manager.leadership.leading_since
        reply = mpb.ClusterStateResponse(
            manager_id=self.manager.config.manager_id,
            leading_for_s=0.0 if since is None else time.monotonic() - since,
        )
        for m in state.members:
            reply.servers.add(
                server_id=m.info.server_id,
                address=m.info.address,
                capacity_blocks=m.info.capacity_blocks,
                free_blocks=m.free_blocks,
                used_blocks=m.info.capacity_blocks - m.free_blocks,
                num_sequences=int(m.load),
                block_size=m.info.block_size,
                node_name=m.info.node_name,
                cached_blocks=cached.get(m.info.server_id, 0),
                draining=m.info.server_id in draining,
            )
        for seq_id, entries in sorted(state.ledger.items()):
            reply.ledger.add(
                seq_id=seq_id,
                shares=[mpb.KVShare(server_id=s, num_blocks=n) for s, n in entries],
                instance_id=state.owners.get(seq_id, ""),
            )
        reply.compute_instances.extend(compute_state_to_proto(c) for c in state.computes)
        now = time.monotonic()
        for r in self.manager.refusals.recent():
            reply.refused.add(
                kind=r.kind,
                member_id=r.member_id,
                address=r.address,
                reason=r.reason,
                attempts=r.times,
                first_refused_ago_s=now - r.first_at,
                last_refused_ago_s=now - r.last_at,
            )
        claims = self.manager.admission_claims()
        at = claims.now()
        for seq_id, c in claims.waiting():
            reply.waiting_admissions.add(
                seq_id=seq_id,
                instance_id=c.owner,
                num_blocks=c.n_blocks,
                waiting_s=at - c.since,
                holding=claims.holds(c, at),
            )
        return reply

    # ---- compute instances -----------------------------------------------------------------------
    async def RegisterCompute(self, request: mpb.RegisterComputeRequest, context) -> mpb.RegisterComputeResponse:  # noqa: N802, ANN001
        homes, identity = tuple(request.home_server_ids), peer_of(context).identity
        kv = kv_layout_of(request.layout)
        info = ComputeInfo(request.instance_id, request.address, homes, request.node_name, identity, kv)
        reg = await self.manager.register_compute(info)
        return mpb.RegisterComputeResponse(lease_ttl_s=reg.ttl_s)

    async def HeartbeatCompute(self, request: mpb.HeartbeatComputeRequest, context) -> mpb.HeartbeatComputeResponse:  # noqa: N802, ANN001
        self.manager.computes.check_owner(request.instance_id, peer_of(context).identity, request.address)
        load = ComputeLoad(request.num_running, request.num_waiting, request.num_tokens_held, time.monotonic())
        await self.manager.heartbeat_compute(request.instance_id, load)
        if self.reports is not None and request.reports_seq_ids:
            self.reports.compute(request.instance_id, request.seq_ids)
        if request.reports_waiting_seq_ids:
            self.manager.admission_claims().renew(request.instance_id, request.waiting_seq_ids)
        return await self._migrations(request)

    async def _migrations(self, request: mpb.HeartbeatComputeRequest) -> mpb.HeartbeatComputeResponse:
        """Feed the step timings to the planner, settle ended migrations, hand out new orders."""
        m = self.manager
        m.rebalancer.observe_steps(
            request.instance_id, request.num_running, request.num_tokens_held, request.num_steps, request.mean_step_s
        )
        results = [
            MigrationResult(
                r.migration_id, r.seq_id, r.src_server_id, r.dst_server_id, r.num_blocks, r.num_moved,
                r.bytes_moved, r.error, tuple(r.cached_hashes), tuple(r.block_indices),
            )
            for r in request.migration_results
        ]  # fmt: skip
        for result in results:  # all checked before any is settled
            m.migrations.check(result, request.instance_id)
        for result in results:
            before = m.migrations.migrations_total
            await m.migrations.settle(result)
            self.metrics.migrations.inc(m.migrations.migrations_total - before)
            if result.block_indices:  # a re-attach: no KV moved
                self.metrics.reattached_rblocks.inc(result.num_moved)
                continue
            self.metrics.migrated_rblocks.inc(result.num_moved)
            self.metrics.migrated_bytes.inc(result.bytes_moved)
        orders = [
            mpb.MigrationOrder(
                migration_id=o.migration_id, seq_id=o.seq_id, src_server_id=o.src, src_address=o.src_address,
                dst_server_id=o.dst, dst_address=o.dst_address, reservation_ids=o.reservation_ids,
                block_indices=o.block_indices, drain=o.drain,
            )
            for o in m.migrations.take_orders(request.instance_id)
        ]  # fmt: skip
        return mpb.HeartbeatComputeResponse(migrations=orders)

    async def DeregisterCompute(self, request: mpb.DeregisterComputeRequest, context) -> mpb.DeregisterComputeResponse:  # noqa: N802, ANN001
        self.manager.computes.check_owner(request.instance_id, peer_of(context).identity, request.address)
        await self.manager.deregister_compute(request.instance_id)
        return mpb.DeregisterComputeResponse()

    async def ListComputeInstances(self, request: mpb.ListComputeInstancesRequest, context):  # noqa: N802, ANN001
        states = await self.manager.compute_instances(include_debts=request.include_debts)
        return mpb.ListComputeInstancesResponse(instances=[compute_state_to_proto(c) for c in states])


def compute_state_to_proto(c: ComputeState) -> mpb.ComputeInstanceState:
    """One live compute instance on the wire; ``debt_blocks`` stays unset where debts were not counted."""
    msg = mpb.ComputeInstanceState(
        instance_id=c.info.instance_id,
        address=c.info.address,
        home_server_ids=c.homes,
        node_name=c.info.node_name,
        num_running=c.load.num_running,
        num_waiting=c.load.num_waiting,
        num_tokens_held=c.load.num_tokens_held,
        heartbeat_age_s=heartbeat_age_s(c.load),
    )
    if c.debt_blocks is not None:
        msg.debt_blocks = c.debt_blocks
    return msg
