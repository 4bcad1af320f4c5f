"""The manager's in-memory capacity view: free rBlocks and load per server, from heartbeats.

PAPER.md "Managers": the gManager's global view is built from periodic heartbeats and may be stale, so a
placement reserves on the server before use (DESIGN.md §5) and this view is only a guide. Between
heartbeats the manager keeps it roughly current itself: blocks it places are taken off, blocks it releases
are given back. A server that refuses a reservation is marked stale (free treated as 0) until its next
heartbeat. Pure bookkeeping: no etcd, no network.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace


@dataclass
class ServerCapacity:
    """One server as last seen: ``free_blocks`` (rBlocks), ``load`` (e.g. sequences served), ``stale``."""

    capacity_blocks: int
    free_blocks: int
    load: float = 0.0
    stale: bool = False
    heartbeat_at: float | None = None  # time.monotonic() seconds of the last heartbeat


class CapacityView:
    """Free rBlocks and load per server id; every method tolerates unknown ids where noted."""

    def __init__(self) -> None:
        self._servers: dict[str, ServerCapacity] = {}

    def add(self, server_id: str, capacity_blocks: int, used_blocks: int = 0) -> None:
        """Track a (re)registered server with ``used_blocks`` of its ``capacity_blocks`` already placed."""
        free = max(capacity_blocks - used_blocks, 0)
        self._servers[server_id] = ServerCapacity(capacity_blocks, free)

    def remove(self, server_id: str) -> None:
        self._servers.pop(server_id, None)

    def heartbeat(self, server_id: str, free_blocks: int, load: float, now: float | None = None) -> None:
        """Replace the estimate with the server's own report (clears ``stale``); unknown ids are ignored."""
        s = self._servers.get(server_id)
        if s is None:
            return
        s.free_blocks = min(max(free_blocks, 0), s.capacity_blocks)
        s.load, s.stale = load, False
        s.heartbeat_at = time.monotonic() if now is None else now

    def take(self, server_id: str, n: int) -> None:
        """``n`` rBlocks of the server are being placed: off the estimate (not below 0)."""
        s = self._servers.get(server_id)
        if s is not None:
            s.free_blocks = max(s.free_blocks - n, 0)

    def give_back(self, server_id: str, n: int) -> None:
        """``n`` rBlocks of the server were released or a reservation cancelled (not above capacity)."""
        s = self._servers.get(server_id)
        if s is not None:
            s.free_blocks = min(s.free_blocks + n, s.capacity_blocks)

    def mark_stale(self, server_id: str) -> None:
        """The server refused a reservation the view said it could meet: trust nothing until a heartbeat."""
        s = self._servers.get(server_id)
        if s is not None:
            s.free_blocks, s.stale = 0, True

    def free_blocks(self) -> dict[str, int]:
        """Estimated free rBlocks per server id."""
        return {sid: s.free_blocks for sid, s in self._servers.items()}

    def totals(self) -> tuple[int, int]:
        """``(capacity, free)``: rBlocks of every tracked server, and the estimate of those free."""
        servers = self._servers.values()
        return sum(s.capacity_blocks for s in servers), sum(s.free_blocks for s in servers)

    def get(self, server_id: str) -> ServerCapacity | None:
        s = self._servers.get(server_id)
        return None if s is None else replace(s)

    def __contains__(self, server_id: str) -> bool:
        return server_id in self._servers
