"""A compute instance's membership: register with the global manager, heartbeat its load, leave on stop.

It registers the address the router dials and its home attention servers (named, or those on its node), then
heartbeats its batch size, queue and the tokens its running sequences hold, through the shared
:class:`~infinite_llm.services.lease_keeper.LeaseKeeper` loop. Routers follow the manager's list, so a
graceful stop deregisters first (no new requests arrive while the running ones drain); a crash is noticed
when the lease expires.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import tensor_pb2
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.options import serving_only
from infinite_llm.services.compute.migration import MigrationExecutor, MigrationResult, Order
from infinite_llm.services.lease_keeper import LeaseKeeper

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ComputeLoadReport:
    """What a heartbeat carries: sequences running (the batch) and waiting (the queue), and the tokens whose
    KV the running sequences hold."""

    num_running: int
    num_waiting: int
    num_tokens_held: int
    num_steps: int = 0  # decode steps since the last report
    mean_step_s: float = 0.0  # their mean wall time (seconds)
    # Sequences it holds or is placing rBlocks for, for the manager's orphan reconciliation (None: not told;
    # the manager then reclaims none of its ledger entries for want of a listing).
    seq_ids: tuple[str, ...] | None = None
    # Its waiting sequences whose admission the manager refused (their claims are renewed; None: not told)
    waiting_seq_ids: tuple[str, ...] | None = None


class ComputeRegistrar:
    """Keeps one compute instance registered; ``load()`` is read on every heartbeat. ``on_refused``
    (optional): awaited with the manager's reason when it refuses the registration (another KV layout, the id
    held by another identity) and with ``None`` once it admits it."""

    def __init__(
        self,
        manager_address: str,
        instance_id: str,
        address: str,
        load: Callable[[], ComputeLoadReport],
        home_server_ids: tuple[str, ...] = (),
        node_name: str = "",
        layout: tensor_pb2.KVLayout | None = None,
        on_refused: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        self._stub = mgrpc.GlobalManagerStub(
            aio_channel(manager_address, timeout_s=CALL_TIMEOUT_S, extra_options=serving_only())
        )
        self.instance_id, self.address = instance_id, address
        self.home_server_ids, self.node_name = home_server_ids, node_name
        self.layout = layout  # the KV its model and dtype need (the manager refuses one unlike its members')
        self._load = load
        self._keeper = LeaseKeeper(instance_id, self._register, self._heartbeat, on_refused=on_refused)
        self.registered = self._keeper.registered
        self.migrations: MigrationExecutor | None = None  # receives the manager's migration orders
        self._refused: list[MigrationResult] = []  # orders refused for want of an executor, to report

    def start(self) -> None:
        self._keeper.start()

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; with ``deregister`` leave the manager's list now rather than after the TTL."""
        await self._keeper.stop()
        was_registered = self.registered.is_set()
        self.registered.clear()
        if deregister and was_registered:
            try:
                await self._stub.DeregisterCompute(
                    mpb.DeregisterComputeRequest(instance_id=self.instance_id, address=self.address),
                    timeout=CALL_TIMEOUT_S,
                )
            except grpc.RpcError as e:  # expired already, or the manager is gone: the lease lapses anyway
                log.warning("deregistering %s failed (%s); its lease will lapse", self.instance_id, e.code().name)

    async def _register(self) -> float:
        reply = await self._stub.RegisterCompute(
            mpb.RegisterComputeRequest(
                instance_id=self.instance_id,
                address=self.address,
                home_server_ids=self.home_server_ids,
                node_name=self.node_name,
                layout=self.layout,
            ),
            timeout=CALL_TIMEOUT_S,
        )
        log.info(
            "registered compute instance %s at %s (homes %s, node %s; TTL %d s)",
            self.instance_id,
            self.address,
            ", ".join(self.home_server_ids) or "-",
            self.node_name or "-",
            reply.lease_ttl_s,
        )
        return float(reply.lease_ttl_s)

    async def _heartbeat(self) -> None:
        load = self._load()
        results, self._refused = self._refused, []
        results += self.migrations.take_results() if self.migrations is not None else []
        reply = await self._stub.HeartbeatCompute(
            mpb.HeartbeatComputeRequest(
                instance_id=self.instance_id,
                address=self.address,
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_tokens_held=load.num_tokens_held,
                seq_ids=load.seq_ids or (),
                reports_seq_ids=load.seq_ids is not None,
                waiting_seq_ids=load.waiting_seq_ids or (),
                reports_waiting_seq_ids=load.waiting_seq_ids is not None,
                num_steps=load.num_steps,
                mean_step_s=load.mean_step_s,
                migration_results=[result_to_proto(r) for r in results],
            ),
            timeout=CALL_TIMEOUT_S,
        )
        for o in reply.migrations:
            self._order(o)

    def _order(self, o: mpb.MigrationOrder) -> None:
        """Hand an order to the executor; without one, report it failed so the manager settles it."""
        order = Order(o.migration_id, o.seq_id, o.src_server_id, o.src_address, o.dst_server_id, o.dst_address,
                      list(o.reservation_ids), list(o.block_indices), drain=o.drain)  # fmt: skip
        if self.migrations is None:
            log.warning("migration order %d refused: this instance runs no migrations", o.migration_id)
            refused = MigrationResult(o.migration_id, o.seq_id, order.src, order.dst, order.num_blocks, 0, 0, "refused",
                                      block_indices=tuple(order.block_indices))  # fmt: skip
            self._refused.append(refused)
            return
        self.migrations.offer(order)


def result_to_proto(r: MigrationResult) -> mpb.MigrationResult:
    return mpb.MigrationResult(
        migration_id=r.migration_id,
        seq_id=r.seq_id,
        src_server_id=r.src,
        dst_server_id=r.dst,
        num_blocks=r.num_blocks,
        num_moved=r.num_moved,
        bytes_moved=r.bytes_moved,
        error=r.error,
        cached_hashes=r.cached_hashes,
        block_indices=r.block_indices,
    )
