"""The rBlock pool: which physical rBlocks of one holder's KV memory are free, reserved or in use.

Pure bookkeeping over block ids (the bytes live in ``kv_cache.KVCache``). Block operations come in pairs,
query then act (``can_allocate`` / ``allocate``) and reserve then commit (PAPER.md "Managers": a remote
placement is reserved on the creditor before any data moves, DESIGN.md §5). Every failed operation raises
a typed error and changes nothing. Reference counts let one block be shared (e.g. a common prefix).

Free-list order is a spec (tests assert it): allocation takes ids from the front; a freed block goes to
the back, in the order given. A fresh pool hands out ``0, 1, 2, ...``.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from infinite_llm.core.errors import CapacityExhausted, InvalidRequest, NotFound


@dataclass(frozen=True)
class Reservation:
    """Blocks taken off the free list but not yet readable; ``commit`` or ``cancel`` ends it."""

    reservation_id: int
    block_ids: tuple[int, ...]


class RBlockPool:
    """Free list, reference counts and reservations of ``num_blocks`` rBlocks.

    Raises:
        CapacityExhausted: an allocation or reservation asks for more blocks than are free.
        NotFound: an unknown reservation id.
        InvalidRequest: freeing or sharing a block that is not in use.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._reservations: dict[int, tuple[int, ...]] = {}
        self._next_reservation = itertools.count(1)

    @classmethod
    def from_bytes(cls, capacity_bytes: int, bytes_per_block: int) -> RBlockPool:
        """A pool holding as many whole rBlocks as fit in ``capacity_bytes`` (bytes)."""
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
        return cls(capacity_bytes // bytes_per_block)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return sum(len(b) for b in self._reservations.values())

    @property
    def num_used(self) -> int:
        """Blocks in use (reference count > 0); reserved blocks are not counted."""
        return self.num_blocks - self.num_free - self.num_reserved

    def free_block_ids(self) -> list[int]:
        """The free list, front (next to be allocated) first."""
        return list(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    # ---- state changes ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free list, each with reference count 1."""
        ids = self._take(n)
        for b in ids:
            self._ref_counts[b] = 1
        return ids

    def reserve(self, n: int) -> Reservation:
        """Take ``n`` blocks off the free list without making them usable (phase one of two)."""
        ids = tuple(self._take(n))
        rid = next(self._next_reservation)
        self._reservations[rid] = ids
        return Reservation(rid, ids)

    def commit(self, reservation_id: int) -> list[int]:
        """Make a reservation's blocks usable (reference count 1) and return their ids."""
        ids = self._pop_reservation(reservation_id)
        for b in ids:
            assert self._ref_counts[b] == 0, f"reserved block {b} already in use"
            self._ref_counts[b] = 1
        return list(ids)

    def reserved_ids(self, reservation_id: int) -> tuple[int, ...]:
        """Block ids held by an open reservation. Raises ``NotFound`` for an unknown id."""
        try:
            return self._reservations[reservation_id]
        except KeyError:
            raise NotFound(f"no reservation {reservation_id}") from None

    def cancel(self, reservation_id: int) -> None:
        """Return a reservation's blocks to the back of the free list."""
        self._free.extend(self._pop_reservation(reservation_id))

    def share(self, block_id: int) -> None:
        """Add a reference to a block in use."""
        self._check_in_use(block_id)
        self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the back of the free list.

        Validates every id first, so a bad id frees nothing.
        """
        drops: dict[int, int] = {}
        for b in block_ids:
            self._check_in_use(b)
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self._ref_counts[b]:
                raise InvalidRequest(f"block {b} freed more times than it is referenced")
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    # ---- helpers ---------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n < 0:
            raise InvalidRequest(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise CapacityExhausted(f"need {n} rBlocks, only {len(self._free)} of {self.num_blocks} free")
        return [self._free.popleft() for _ in range(n)]

    def _pop_reservation(self, reservation_id: int) -> tuple[int, ...]:
        try:
            return self._reservations.pop(reservation_id)
        except KeyError:
            raise NotFound(f"no reservation {reservation_id}") from None

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidRequest(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _check_in_use(self, block_id: int) -> None:
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise InvalidRequest(f"block {block_id} is not in use")
