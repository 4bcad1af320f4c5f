"""The router follows the compute instances the global manager lists.

Compute instances register with the manager under a lease (``services/compute/registrar.py``); the router
asks ``ListComputeInstances`` every ``interval_s`` seconds and hands the live set of addresses to the
servicer, so a new instance starts receiving requests within one interval and one that left (deregistered,
or its lease expired) stops. An unreachable manager changes nothing: the router keeps the last list it saw
(requests to an instance that died meanwhile fail over before their first token).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.options import serving_only

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 1.0  # how often the router re-reads the list (seconds); well under a lease TTL


class ComputeDiscovery:
    """Polls the manager's compute instances; ``on_change({address: instance_id})`` on every change."""

    def __init__(
        self,
        manager_address: str,
        on_change: Callable[[dict[str, str]], None],
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"discovery interval must be > 0 s, got {interval_s}")
        self.manager_address = manager_address
        self.interval_s = interval_s
        self._on_change = on_change
        self._channel = aio_channel(manager_address, timeout_s=max(interval_s, 2.0), extra_options=serving_only())
        self._stub = mgrpc.GlobalManagerStub(self._channel)
        self._known: dict[str, str] | None = None
        self._task: asyncio.Task | None = None

    async def refresh(self) -> bool:
        """Read the list once and apply it if it changed; False when the manager could not be asked."""
        try:
            reply = await self._stub.ListComputeInstances(mpb.ListComputeInstancesRequest())
        except grpc.RpcError as e:
            log.warning("manager %s unreachable (%s); keeping the last list", self.manager_address, e.code().name)
            return False
        live = {i.address: i.instance_id for i in reply.instances}
        if live != self._known:
            log.info("compute instances: %s", ", ".join(f"{n} at {a}" for a, n in sorted(live.items())) or "none")
            self._known = live
            self._on_change(dict(live))
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="compute-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._channel.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
