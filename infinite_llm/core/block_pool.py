"""The rBlock pool: which physical rBlocks of one holder's KV memory are free, reserved or in use.

Pure bookkeeping over block ids (the bytes live in ``kv_cache.KVCache``). Block operations come in pairs,
query then act (``can_allocate`` / ``allocate``) and reserve then commit (PAPER.md "Managers": a remote
placement is reserved on the creditor before any data moves, DESIGN.md §5). Every failed operation raises
a typed error and changes nothing. Reference counts let one block be shared (e.g. a common prefix).

Free-list order is a spec (tests assert it): allocation takes ids from the front; a freed block goes to
the back, in the order given. A fresh pool hands out ``0, 1, 2, ...``.

Prefix caching: a block marked *cached* (:meth:`mark_cached`: its KV is complete and indexed by hash) that
loses its last reader is not cleared but parked in a second, LRU-ordered list. It still counts as free:
an allocation takes plain free blocks first and evicts parked ones, least recently used first, only when
those run out, reporting each evicted id to ``on_evict`` (so the index drops it in the same call). A
parked block can be read again (:meth:`revive`). Source: vLLM v1 ``block_pool.py`` (``FreeKVCacheBlockQueue``
holding cached blocks with no reader, evicted on allocation).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
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

    def __init__(self, num_blocks: int, on_evict: Callable[[list[int]], None] | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict  # told the ids of cached blocks an allocation evicted, in eviction order
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: set[int] = set()  # blocks whose KV is indexed by hash (read or parked)
        self._parked: OrderedDict[int, None] = OrderedDict()  # cached, no reader; front = least recently used
        self._ref_counts = [0] * num_blocks
        self._reservations: dict[int, tuple[int, ...]] = {}
        self._shared_reservations: dict[int, tuple[int, ...]] = {}  # references to cached blocks, held
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
        """Blocks an allocation can take: plain free ones plus cached ones with no reader (evictable)."""
        return len(self._free) + len(self._parked)

    @property
    def num_cached(self) -> int:
        """Cached blocks, read or not."""
        return len(self._cached)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks with no reader (evictable, least recently used first)."""
        return len(self._parked)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    @property
    def num_reserved(self) -> int:
        return sum(len(b) for b in self._reservations.values())

    @property
    def num_used(self) -> int:
        """Blocks in use (reference count > 0); reserved blocks are not counted."""
        return self.num_blocks - self.num_free - self.num_reserved

    def free_block_ids(self) -> list[int]:
        """The free list, front (next to be allocated) first: plain free blocks, then parked cached ones."""
        return list(self._free) + list(self._parked)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

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

    def reserve_cached(self, block_ids: list[int]) -> Reservation:
        """Hold one reference more to each of these cached blocks (parked or read), under a reservation:
        they cannot be evicted meanwhile; ``commit`` hands the references over, ``cancel`` drops them. Used
        to re-attach a reader to a shared block that a migration moved here."""
        for b in block_ids:
            self._check_id(b)
            if b not in self._cached:
                raise InvalidRequest(f"block {b} is not cached")
        for b in block_ids:
            self.revive(b)
        rid = next(self._next_reservation)
        self._shared_reservations[rid] = tuple(block_ids)
        return Reservation(rid, tuple(block_ids))

    def commit(self, reservation_id: int) -> list[int]:
        """Make a reservation's blocks usable (reference count 1; a :meth:`reserve_cached` one keeps its
        references) and return their ids."""
        shared = self._shared_reservations.pop(reservation_id, None)
        if shared is not None:
            return list(shared)
        ids = self._pop_reservation(reservation_id)
        for b in ids:
            assert self._ref_counts[b] == 0, f"reserved block {b} already in use"
            self._ref_counts[b] = 1
        return list(ids)

    def reserved_ids(self, reservation_id: int) -> tuple[int, ...]:
        """Block ids held by an open reservation. Raises ``NotFound`` for an unknown id."""
        found = self._reservations.get(reservation_id, self._shared_reservations.get(reservation_id))
        if found is None:
            raise NotFound(f"no reservation {reservation_id}")
        return found

    def cancel(self, reservation_id: int) -> None:
        """Return a reservation's blocks to the back of the free list (a :meth:`reserve_cached` one: drop its
        references)."""
        shared = self._shared_reservations.pop(reservation_id, None)
        if shared is not None:
            self.free(shared)
            return
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
                if b in self._cached:
                    self._parked[b] = None  # most recently used: evicted last
                else:
                    self._free.append(b)

    # ---- prefix caching ------------------------------------------------------------------------------
    def mark_cached(self, block_id: int) -> None:
        """Mark a block in use as cached: when its last reader frees it, it is parked, not cleared."""
        self._check_in_use(block_id)
        self._cached.add(block_id)

    def revive(self, block_id: int) -> None:
        """Add a reader to a cached block, parked or in use (a prefix-cache hit)."""
        self._check_id(block_id)
        if block_id not in self._cached:
            raise InvalidRequest(f"block {block_id} is not cached")
        if self._ref_counts[block_id] == 0:
            del self._parked[block_id]
        self._ref_counts[block_id] += 1

    def evict_cached(self, block_ids: list[int] | None = None) -> list[int]:
        """Uncache ``block_ids`` (``None``: every cached block): parked ones become plain free blocks (at
        the back of the free list), read ones stay with their readers and are freed as private blocks.
        Reports the ids to ``on_evict`` and returns them."""
        if block_ids is None:  # parked ones in LRU order, then those being read
            block_ids = list(self._parked) + sorted(self._cached - self._parked.keys())
        ids = [b for b in block_ids if b in self._cached]
        for b in ids:
            self._cached.discard(b)
            if b in self._parked:
                del self._parked[b]
                self._free.append(b)
        if ids and self.on_evict is not None:
            self.on_evict(ids)
        return ids

    # ---- helpers ---------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        """``n`` blocks: plain free ones first, then parked cached ones, least recently used first (evicted)."""
        if n < 0:
            raise InvalidRequest(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise CapacityExhausted(f"need {n} rBlocks, only {self.num_free} of {self.num_blocks} free")
        ids = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        evicted = [self._parked.popitem(last=False)[0] for _ in range(n - len(ids))]
        if evicted:
            self._cached.difference_update(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
        return ids + evicted

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
