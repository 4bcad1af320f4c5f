"""An attention server's membership: register with the global manager, then heartbeat its free rBlocks.

The manager keeps the server's ``members/<id>`` key under an etcd lease that each heartbeat refreshes; a
server that stops heartbeating (dies) vanishes when the lease expires. A heartbeat answered NOT_FOUND
means the lease already expired (or the manager restarted): register again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.services.attention.types import HolderStats

log = logging.getLogger(__name__)
RETRY_S = 1.0  # wait before retrying an unreachable manager (seconds)


class Registrar:
    """Keeps one server registered; ``stats()`` is read on every heartbeat."""

    def __init__(
        self, manager_address: str, server_id: str, address: str, block_size: int, stats: Callable[[], HolderStats]
    ) -> None:
        self._stub = mgrpc.GlobalManagerStub(aio_channel(manager_address, timeout_s=5.0))
        self.server_id, self.address, self.block_size = server_id, address, block_size
        self._stats = stats
        self._task: asyncio.Task | None = None
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"registrar-{self.server_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                ttl = await self._register()
                self.registered.set()
                while await self._heartbeat():
                    await asyncio.sleep(max(ttl / 3, 0.5))
                log.warning("lease of %s expired; registering again", self.server_id)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # e.g. another block size: fix the config
                    log.error("the manager refuses %s: %s; retrying", self.server_id, e.details())
                else:
                    log.warning("manager unreachable (%s); retrying", e.code().name)
                await asyncio.sleep(RETRY_S)

    async def _register(self) -> float:
        s = self._stats()
        reply = await self._stub.Register(
            mpb.RegisterRequest(
                server_id=self.server_id,
                address=self.address,
                capacity_blocks=s.num_blocks,
                block_size=self.block_size,
                kind="attention",
            )
        )
        log.info(
            "registered %s at %s with %d rBlocks (lease %d s)",
            self.server_id,
            self.address,
            s.num_blocks,
            reply.lease_ttl_s,
        )
        return float(reply.lease_ttl_s)

    async def _heartbeat(self) -> bool:
        """One heartbeat; False when the manager no longer knows this server."""
        s = self._stats()
        try:
            await self._stub.Heartbeat(
                mpb.HeartbeatRequest(
                    server_id=self.server_id,
                    free_blocks=s.num_free,
                    used_blocks=s.num_used,
                    num_sequences=s.num_sequences,
                )
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True
