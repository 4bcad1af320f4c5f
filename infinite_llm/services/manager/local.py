"""In-process :class:`BlockServers` over :class:`RManager` objects (single-process meshes and tests).

The gRPC attention-server client implements the same calls remotely; this one runs them on rManagers
in this process, so the bookkeeping the manager relies on is the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import Unavailable

if TYPE_CHECKING:  # the manager process does not load torch (RManager's module does)
    from infinite_llm.core.rmanager import RManager


class LocalServers:
    """``server_id -> RManager``; an unknown server id raises ``Unavailable`` (as an unreachable one)."""

    def __init__(self, rmanagers: dict[str, RManager]) -> None:
        self.rmanagers = rmanagers
        # Told ``(server_id, hashes)`` the moment an rManager's cache drops them (an attention server tells
        # the manager in its next reserve reply instead).
        self.on_uncached: Callable[[str, list[bytes]], None] | None = None
        for server_id, rm in rmanagers.items():
            rm.on_uncache = partial(self._uncached, server_id)

    def _uncached(self, server_id: str, hashes: list[bytes]) -> None:
        if self.on_uncached is not None:
            self.on_uncached(server_id, hashes)

    def _get(self, server_id: str) -> RManager:
        rm = self.rmanagers.get(server_id)
        if rm is None:
            raise Unavailable(f"attention server {server_id!r} is not reachable")
        if rm.on_uncache is None:  # added after construction
            rm.on_uncache = partial(self._uncached, server_id)
        return rm

    async def reserve(self, server_id: str, seq_id: str, n: int) -> Reservation:
        """Hold ``n`` rBlocks for ``seq_id``. Raises CapacityExhausted (nothing changes) if too few are free."""
        return self._get(server_id).reserve(seq_id, n)

    async def commit(self, server_id: str, reservation_id: int, block_indices: list[int]) -> list[int]:
        """The reserved rBlocks now belong to their sequence at logical ``block_indices``; returns their ids."""
        return self._get(server_id).commit(reservation_id, block_indices)

    async def cancel(self, server_id: str, reservation_id: int) -> None:
        self._get(server_id).cancel(reservation_id)

    async def free(self, server_id: str, seq_id: str) -> int:
        """Free every rBlock and reservation of ``seq_id`` on the server; returns rBlocks freed."""
        return self._get(server_id).free_sequence(seq_id)

    async def truncate(self, server_id: str, seq_id: str, first_index: int) -> int:
        """Free ``seq_id``'s committed rBlocks at logical index ``>= first_index``; returns rBlocks left."""
        rm = self._get(server_id)
        rm.free_from(seq_id, first_index)
        return len(rm.owned_blocks(seq_id))

    async def attach(
        self, server_id: str, seq_id: str, first_index: int, hashes: list[bytes]
    ) -> tuple[list[int], list[bytes]]:
        """The longest prefix of ``hashes`` cached on the server, attached to ``seq_id`` at ``first_index ..``."""
        rm = self._get(server_id)
        n = 0
        while n < len(hashes) and rm.cached_block(hashes[n]) is not None:
            n += 1
        return (rm.attach(seq_id, list(range(first_index, first_index + n)), hashes[:n]) if n else []), []

    async def cache(self, server_id: str, seq_id: str, block_indices: list[int], hashes: list[bytes]) -> list[bytes]:
        """Mark ``seq_id``'s rBlocks at ``block_indices`` cached; returns the hashes newly cached."""
        rm = self._get(server_id)
        known = {h for h in hashes if rm.cached_block(h) is not None}
        rm.cache_blocks(seq_id, list(zip(block_indices, hashes, strict=True)))
        return [h for h in dict.fromkeys(hashes) if h not in known and rm.cached_block(h) is not None]

    async def readers(self, server_id: str, hashes: list[bytes]) -> list[tuple[bytes, str, int]]:
        """``(hash, seq_id, logical index)`` of the sequences reading the cached rBlock of each hash."""
        return self._get(server_id).readers(hashes)

    async def reserve_attach(self, server_id: str, seq_id: str, hashes: list[bytes]) -> tuple[Reservation, list[bytes]]:
        """A reservation of references to the cached rBlocks of the longest cached prefix of ``hashes``."""
        return self._get(server_id).reserve_cached(seq_id, hashes), []
