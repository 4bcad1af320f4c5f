"""An attention server's membership: register with the global manager, then heartbeat its free rBlocks.

The loop (register, heartbeat every TTL/3, register again after NOT_FOUND) is the shared
:class:`~infinite_llm.services.lease_keeper.LeaseKeeper`; this module says what an attention server sends.
``node_name`` (Kubernetes: the pod's ``spec.nodeName``) makes it a home of the compute instances on that node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import tensor_pb2
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.options import serving_only
from infinite_llm.services.attention.types import HolderStats
from infinite_llm.services.lease_keeper import LeaseKeeper

log = logging.getLogger(__name__)


class Registrar:
    """Keeps one server registered; ``stats()`` is read on every heartbeat.

    ``occupancy()`` (optional): ``(committed, reserved)`` rBlocks per sequence, sent with each heartbeat for
    the manager's orphan reconciliation. ``on_stalled`` (optional): awaited before registering again after
    this process stalled past a heartbeat (its lease likely lapsed); the server drops its rBlocks there
    (fenced: it rejoins empty). ``layout``: the KV it keeps, told to the manager at registration (``None``:
    not told). ``on_refused`` (optional): awaited with the manager's reason when it refuses the registration
    (another layout or block size, the id held by another server) and with ``None`` once it admits it.
    """

    def __init__(
        self,
        manager_address: str,
        server_id: str,
        address: str,
        block_size: int,
        stats: Callable[[], HolderStats],
        node_name: str = "",
        occupancy: Callable[[], tuple[dict[str, int], dict[str, int]]] | None = None,
        on_stalled: Callable[[], Awaitable[None]] | None = None,
        layout: tensor_pb2.KVLayout | None = None,
        on_refused: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        self._stub = mgrpc.GlobalManagerStub(aio_channel(manager_address, timeout_s=5.0, extra_options=serving_only()))
        self.server_id, self.address, self.block_size, self.node_name = server_id, address, block_size, node_name
        self.layout = layout  # the KV kept here (the manager refuses a layout unlike its live members')
        self._stats, self._occupancy = stats, occupancy
        self._keeper = LeaseKeeper(server_id, self._register, self._heartbeat, on_stalled, on_refused)
        self.registered = self._keeper.registered
        self.draining = False  # sent with every heartbeat from :meth:`announce_draining` on
        self._beating = asyncio.Lock()  # one heartbeat at a time: an older one never lands after a newer one

    def start(self) -> None:
        self._keeper.start()

    async def stop(self) -> None:
        await self._keeper.stop()

    async def deregister(self) -> None:
        """Leave the cluster now (after :meth:`stop`): the manager stops listing this server at once instead of
        when its lease lapses. Never raises: a manager that cannot be told lets the lease lapse."""
        if not self.registered.is_set():  # never admitted: the id may be another live server's
            log.info("%s never registered: nothing to deregister", self.server_id)
            return
        try:
            await self._stub.Deregister(mpb.DeregisterRequest(server_id=self.server_id, address=self.address))
            log.info("deregistered %s", self.server_id)
        except grpc.RpcError as e:
            log.info("could not deregister %s (%s); its lease lapses instead", self.server_id, e.code().name)

    async def announce_draining(self) -> None:
        """Tell the manager now that this server is stopping (a heartbeat with ``draining``; every later one
        says so too): it places nothing new here and migrates what is here away.

        Raises:
            grpc.RpcError: the manager did not take it (unreachable, or the lease already lapsed).
        """
        self.draining = True
        await self._heartbeat()

    async def _register(self) -> float:
        s = self._stats()
        reply = await self._stub.Register(
            mpb.RegisterRequest(
                server_id=self.server_id,
                address=self.address,
                capacity_blocks=s.num_blocks,
                block_size=self.block_size,
                kind="attention",
                node_name=self.node_name,
                layout=self.layout,
            )
        )
        log.info(
            "registered %s at %s with %d rBlocks (TTL %d s)",
            self.server_id,
            self.address,
            s.num_blocks,
            reply.lease_ttl_s,
        )
        return float(reply.lease_ttl_s)

    async def _heartbeat(self) -> None:
        async with self._beating:
            await self._send_heartbeat()

    async def _send_heartbeat(self) -> None:
        s = self._stats()
        request = mpb.HeartbeatRequest(
            server_id=self.server_id,
            address=self.address,
            free_blocks=s.num_free,
            used_blocks=s.num_used,
            num_sequences=s.num_sequences,
            draining=self.draining,
        )
        if self._occupancy is not None:
            committed, reserved = self._occupancy()
            request.reports_sequences = True
            request.sequences.extend(mpb.SeqBlocks(seq_id=q, num_blocks=n) for q, n in committed.items())
            request.reserved.extend(mpb.SeqBlocks(seq_id=q, num_blocks=n) for q, n in reserved.items())
        await self._stub.Heartbeat(request)
