"""Where a sequence's new rBlocks go, and reserving them on the chosen servers.

Policy (PAPER.md "Managers", "Cluster scheduling"): the owning compute instance's home servers first (its KV
stays local; ``near``, the server of the sequence's last rBlock, first among them), most free first; when home
is full, the servers the planner lets it borrow from (``lenders``, best first: :func:`~.planner.lenders`,
never a server whose owner is itself borrowing), or every server by most free rBlocks when no lender list is
given. The capacity view may be stale, so every share is reserved on its server before it counts
(reserve-then-transfer, DESIGN.md §5); a server that refuses is marked stale and the rest goes elsewhere. If
the whole request cannot be met, every reservation made is cancelled and :class:`CapacityExhausted` is raised:
nothing is leaked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import CapacityExhausted, DeadlineExceeded, NotFound, Unavailable
from infinite_llm.services.manager.capacity import CapacityView

log = logging.getLogger(__name__)


class BlockServers(Protocol):
    """The manager's hands on the attention servers' rBlock pools (gRPC in production, in-process in tests).

    Every method raises ``Unavailable`` if the server cannot be reached; ``reserve`` raises
    ``CapacityExhausted`` (and changes nothing) if the server has fewer than ``n`` free rBlocks.

    ``on_uncached(server_id, hashes)``, set by the manager, is told the hashes a server reports gone from its
    prefix cache (a reservation evicted them), so the next ledger write takes them out of the index.
    """

    on_uncached: Callable[[str, list[bytes]], None] | None

    async def reserve(self, server_id: str, seq_id: str, n: int) -> Reservation: ...

    async def commit(self, server_id: str, reservation_id: int, block_indices: list[int]) -> list[int]: ...

    async def cancel(self, server_id: str, reservation_id: int) -> None: ...

    async def free(self, server_id: str, seq_id: str) -> int: ...

    async def truncate(self, server_id: str, seq_id: str, first_index: int) -> int:
        """Free ``seq_id``'s committed rBlocks at logical index ``>= first_index``; returns how many of
        its rBlocks the server still holds."""
        ...

    async def attach(
        self, server_id: str, seq_id: str, first_index: int, hashes: list[bytes]
    ) -> tuple[list[int], list[bytes]]:
        """Prefix caching: attach the longest prefix of ``hashes`` cached on the server to ``seq_id`` at
        logical ``first_index ..``; returns ``(block ids, hashes the server uncached since it last said)``."""
        ...

    async def cache(self, server_id: str, seq_id: str, block_indices: list[int], hashes: list[bytes]) -> list[bytes]:
        """Prefix caching: mark ``seq_id``'s rBlocks at ``block_indices`` cached; returns the hashes newly cached."""
        ...

    async def readers(self, server_id: str, hashes: list[bytes]) -> list[tuple[bytes, str, int]]:
        """Prefix caching: ``(hash, seq_id, logical index)`` of each sequence reading the server's cached rBlock
        of each of ``hashes``."""
        ...

    async def reserve_attach(self, server_id: str, seq_id: str, hashes: list[bytes]) -> tuple[Reservation, list[bytes]]:
        """Prefix caching: a reservation holding a reference to the server's cached rBlock of each of the
        longest prefix of ``hashes`` (maybe none) for ``seq_id``, to commit at logical indices later; and the
        hashes the server uncached since it last said."""
        ...


@dataclass(frozen=True)
class Held:
    """A reservation made for a placement, not yet committed."""

    server_id: str
    n_blocks: int
    reservation: Reservation


def choose_servers(
    n_blocks: int,
    free: dict[str, int],
    near: str | None,
    exclude: frozenset[str] = frozenset(),
    homes: tuple[str, ...] = (),
    lenders: tuple[str, ...] | None = None,
) -> list[tuple[str, int]]:
    """Split ``n_blocks`` rBlocks over servers: ``near`` first, then the other ``homes`` by most free, then
    ``lenders`` in their order (``None``: every other server, most free first; ties by server id). A ``near``
    that is not one of ``homes`` (when there are any) is ignored: home first, a borrowed server is never
    preferred.

    Args:
        n_blocks: rBlocks to place.
        free: estimated free rBlocks per server id.
        near: the server local to the sequence's compute instance, or ``None``.
        exclude: servers not to use.
        homes: the owning compute instance's home servers.
        lenders: the only other servers allowed, best first (the planner's :func:`~.planner.lenders`).

    Returns:
        ``[(server_id, n)]`` with every ``n > 0``; the counts sum to less than ``n_blocks`` when the
        estimate does not hold enough.
    """
    if homes and near not in homes:
        near = None
    home = set(homes) | ({near} if near else set())
    rank = {s: i for i, s in enumerate(lenders or ())}
    candidates = [
        (s, f) for s, f in free.items() if f > 0 and s not in exclude and (s in home or lenders is None or s in rank)
    ]
    candidates.sort(key=lambda sf: (sf[0] != near, sf[0] not in home, rank.get(sf[0], 0), -sf[1], sf[0]))
    plan, remaining = [], n_blocks
    for server_id, available in candidates:
        if remaining == 0:
            break
        take = min(available, remaining)
        plan.append((server_id, take))
        remaining -= take
    return plan


async def reserve_placement(
    servers: BlockServers,
    view: CapacityView,
    seq_id: str,
    n_blocks: int,
    near: str | None,
    homes: tuple[str, ...] = (),
    lenders: tuple[str, ...] | None = None,
) -> list[Held]:
    """Reserve ``n_blocks`` rBlocks for ``seq_id`` across servers, one share at a time.

    Each share is taken off the view before its reservation is awaited, so concurrent placements in this
    process do not count the same free blocks twice.

    Raises:
        CapacityExhausted: the cluster cannot hold ``n_blocks`` more; every reservation made is cancelled.
    """
    held: list[Held] = []
    try:
        refused = await _reserve_shares(servers, view, seq_id, n_blocks, (near, homes, lenders), held)
    except BaseException:
        await cancel_held(servers, view, held)
        raise
    reserved = sum(h.n_blocks for h in held)
    if reserved < n_blocks:
        await cancel_held(servers, view, held)
        raise CapacityExhausted(
            f"cannot place {n_blocks} rBlocks for sequence {seq_id!r}: only {reserved} could be reserved "
            f"(servers refusing: {sorted(refused) or 'none'}); nothing was placed"
        )
    return held


async def _reserve_shares(
    servers: BlockServers,
    view: CapacityView,
    seq_id: str,
    n_blocks: int,
    where: tuple[str | None, tuple[str, ...], tuple[str, ...] | None],
    held: list[Held],
) -> set[str]:
    """Reserve shares into ``held`` until ``n_blocks`` are held or no server is left; returns refusers.
    ``where`` is ``(near, homes, lenders)`` of :func:`choose_servers`."""
    near, homes, lenders = where
    refused: set[str] = set()
    remaining = n_blocks
    while remaining > 0:
        used = frozenset(refused | {h.server_id for h in held})
        plan = choose_servers(remaining, view.free_blocks(), near, used, homes, lenders)
        if not plan:
            break
        server_id, n = plan[0]
        view.take(server_id, n)
        try:
            reservation = await servers.reserve(server_id, seq_id, n)
        except (CapacityExhausted, Unavailable, DeadlineExceeded) as e:  # full, down, or not answering (frozen)
            # DEBUG: a sequence waiting for memory retries every step (up to ~10 a second, 4,578 lines in 9.5 min
            # of one walkthrough); the placement_failures counter counts the Place calls refused
            log.debug("reserve %d rBlocks on %s for %s refused: %s", n, server_id, seq_id, e)
            view.mark_stale(server_id)
            refused.add(server_id)
            continue
        held.append(Held(server_id, n, reservation))
        remaining -= n
    return refused


async def cancel_held(servers: BlockServers, view: CapacityView, held: list[Held]) -> None:
    """Cancel reservations and give their blocks back to the view; an unreachable server is skipped."""
    for h in held:
        try:
            await servers.cancel(h.server_id, h.reservation.reservation_id)
        except (Unavailable, NotFound) as e:  # the server died, or already dropped the reservation
            log.warning("cancel reservation %d on %s failed: %s", h.reservation.reservation_id, h.server_id, e)
        view.give_back(h.server_id, h.n_blocks)
