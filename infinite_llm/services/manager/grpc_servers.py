"""The manager's hands on the attention servers over gRPC: the production ``BlockServers``.

Each call goes to the server's ``AttentionServer`` service at the address it registered. Status codes map
back to typed errors (RESOURCE_EXHAUSTED -> ``CapacityExhausted``, UNAVAILABLE -> ``Unavailable``), which
is what the placement code expects.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import Unavailable
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.channels import aio_channel

CALL_TIMEOUT_S = 10.0
# A placement's ReserveBlocks and a release's FreeSequence: a server that does not answer in this long
# (frozen: SIGSTOP, a paused VM) is skipped: placement goes to another server (a reservation it makes late
# expires after RESERVATION_TTL_S), and what it holds of a released sequence is reclaimed as an orphan from
# its later heartbeats (or dropped when it is fenced). The compute instance's engine thread waits on both
# (seconds).
FREE_TIMEOUT_S = 2.0
RESERVE_TIMEOUT_S = 2.0
# A MatchPrefix's AttachBlocks, likewise: a frozen server's cached prefix is skipped (the sequence computes
# that part itself) instead of holding the request's admission for CALL_TIMEOUT_S; what it attaches late is
# reclaimed as an orphan from its heartbeats, or dropped when it is fenced.
ATTACH_TIMEOUT_S = 2.0


class GrpcBlockServers:
    """``BlockServers`` over gRPC; ``address_of(server_id)`` gives a live member's ``host:port`` (or None)."""

    def __init__(self, address_of: Callable[[str], str | None]) -> None:
        self._address_of = address_of
        # Told ``(server_id, hashes)`` a server reports gone from its prefix cache (in reserve replies).
        self.on_uncached: Callable[[str, list[bytes]], None] | None = None
        self._stubs: dict[str, tuple[str, agrpc.AttentionServerStub]] = {}

    def _stub(self, server_id: str) -> agrpc.AttentionServerStub:
        address = self._address_of(server_id)
        if address is None:
            raise Unavailable(f"attention server {server_id!r} is not a live member")
        cached = self._stubs.get(server_id)
        if cached is None or cached[0] != address:
            cached = (address, agrpc.AttentionServerStub(aio_channel(address, timeout_s=CALL_TIMEOUT_S)))
            self._stubs[server_id] = cached
        return cached[1]

    async def reserve(self, server_id: str, seq_id: str, n: int) -> Reservation:
        request = apb.ReserveBlocksRequest(seq_id=seq_id, num_blocks=n)
        reply = await self._call(server_id, "ReserveBlocks", request, RESERVE_TIMEOUT_S)
        if reply.uncached_hashes and self.on_uncached is not None:
            self.on_uncached(server_id, list(reply.uncached_hashes))
        return Reservation(reply.reservation_id, tuple(reply.block_ids))

    async def commit(self, server_id: str, reservation_id: int, block_indices: list[int]) -> list[int]:
        request = apb.CommitBlocksRequest(reservation_id=reservation_id, block_indices=block_indices)
        reply = await self._call(server_id, "CommitBlocks", request)
        return list(reply.block_ids)

    async def cancel(self, server_id: str, reservation_id: int) -> None:
        await self._call(server_id, "CancelReservation", apb.CancelReservationRequest(reservation_id=reservation_id))

    async def free(self, server_id: str, seq_id: str) -> int:
        request = apb.FreeSequenceRequest(seq_id=seq_id)
        return (await self._call(server_id, "FreeSequence", request, FREE_TIMEOUT_S)).num_freed

    async def truncate(self, server_id: str, seq_id: str, first_index: int) -> int:
        request = apb.FreeSequenceRequest(seq_id=seq_id, from_block_index=first_index)
        return (await self._call(server_id, "FreeSequence", request)).num_held

    async def attach(
        self, server_id: str, seq_id: str, first_index: int, hashes: list[bytes]
    ) -> tuple[list[int], list[bytes]]:
        request = apb.AttachBlocksRequest(seq_id=seq_id, first_block_index=first_index, block_hashes=hashes)
        reply = await self._call(server_id, "AttachBlocks", request, ATTACH_TIMEOUT_S)
        return list(reply.block_ids), list(reply.uncached_hashes)

    async def cache(self, server_id: str, seq_id: str, block_indices: list[int], hashes: list[bytes]) -> list[bytes]:
        request = apb.CacheBlocksRequest(seq_id=seq_id, block_indices=block_indices, block_hashes=hashes)
        return list((await self._call(server_id, "CacheBlocks", request)).cached_hashes)

    async def readers(self, server_id: str, hashes: list[bytes]) -> list[tuple[bytes, str, int]]:
        reply = await self._call(server_id, "BlockReaders", apb.BlockReadersRequest(block_hashes=hashes))
        return [(r.block_hash, r.seq_id, r.block_index) for r in reply.readers]

    async def reserve_attach(self, server_id: str, seq_id: str, hashes: list[bytes]) -> tuple[Reservation, list[bytes]]:
        request = apb.AttachBlocksRequest(seq_id=seq_id, block_hashes=hashes, reserve=True)
        reply = await self._call(server_id, "AttachBlocks", request)
        return Reservation(reply.reservation_id, tuple(reply.block_ids)), list(reply.uncached_hashes)

    async def _call(self, server_id: str, method: str, request, timeout_s: float = CALL_TIMEOUT_S):  # noqa: ANN001, ANN202
        try:
            return await getattr(self._stub(server_id), method)(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
