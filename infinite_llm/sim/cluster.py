"""The simulated cluster's state: attention servers as rBlock counters, sequences, compute instances.

:class:`SimServers` implements the manager's :class:`~infinite_llm.services.manager.placement.BlockServers`
(reserve, commit, cancel, free) over counts instead of rBlock pools, so the real
:func:`~infinite_llm.services.manager.placement.reserve_placement` runs against it unchanged. It refuses
exactly as an attention server does: a reservation of more rBlocks than are free raises
``CapacityExhausted`` and changes nothing. :class:`KVTokens` keeps, per server, the KV tokens resident there
(every owner's), which the cost model reads each step.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from infinite_llm.core.block_pool import Reservation
from infinite_llm.core.errors import CapacityExhausted, InvalidRequest, NotFound, Unavailable
from infinite_llm.sim.traces import Request


class SimServers:
    """``server_id -> capacity`` rBlock counters with reservations, per sequence holdings, and releases.

    Same contract as the attention servers' BlockServers calls (unknown server: ``Unavailable``; too few
    free: ``CapacityExhausted``; unknown reservation: ``NotFound``); block ids are not simulated (commit
    returns ``block_indices``).
    """

    def __init__(self, capacity: dict[str, int]) -> None:
        self.capacity = dict(capacity)
        self.free_blocks = dict(capacity)
        self.held: dict[str, dict[str, int]] = {s: {} for s in capacity}  # server -> seq_id -> rBlocks
        self._reservations: dict[int, tuple[str, str, int]] = {}  # id -> (server, seq_id, n)
        self._ids = itertools.count(1)

    def _check(self, server_id: str) -> None:
        if server_id not in self.capacity:
            raise Unavailable(f"attention server {server_id!r} is not reachable")

    async def reserve(self, server_id: str, seq_id: str, n: int) -> Reservation:
        return self.reserve_now(server_id, seq_id, n)

    def reserve_now(self, server_id: str, seq_id: str, n: int) -> Reservation:
        self._check(server_id)
        if n < 1 or n > self.free_blocks[server_id]:
            raise CapacityExhausted(f"{server_id}: {n} rBlocks asked, {self.free_blocks[server_id]} free")
        self.free_blocks[server_id] -= n
        rid = next(self._ids)
        self._reservations[rid] = (server_id, seq_id, n)
        return Reservation(rid, ())

    async def commit(self, server_id: str, reservation_id: int, block_indices: list[int]) -> list[int]:
        self.commit_now(server_id, reservation_id)
        return list(block_indices)

    def commit_now(self, server_id: str, reservation_id: int) -> int:
        """The reservation's rBlocks now belong to its sequence; returns how many."""
        server, seq_id, n = self._pop(server_id, reservation_id)
        held = self.held[server]
        held[seq_id] = held.get(seq_id, 0) + n
        return n

    async def cancel(self, server_id: str, reservation_id: int) -> None:
        self.cancel_now(server_id, reservation_id)

    def cancel_now(self, server_id: str, reservation_id: int) -> None:
        server, _, n = self._pop(server_id, reservation_id)
        self.free_blocks[server] += n

    def _pop(self, server_id: str, reservation_id: int) -> tuple[str, str, int]:
        self._check(server_id)
        r = self._reservations.get(reservation_id)
        if r is None or r[0] != server_id:
            raise NotFound(f"reservation {reservation_id} on {server_id!r}")
        del self._reservations[reservation_id]
        return r

    async def free(self, server_id: str, seq_id: str) -> int:
        self._check(server_id)
        n = self.held[server_id].pop(seq_id, 0)
        self.free_blocks[server_id] += n
        return n

    def release(self, server_id: str, seq_id: str, n: int) -> None:
        """``n`` of ``seq_id``'s rBlocks left ``server_id`` (a migration's source after the flip)."""
        held = self.held[server_id]
        if held.get(seq_id, 0) < n:
            raise InvalidRequest(f"{server_id} holds {held.get(seq_id, 0)} rBlocks of {seq_id}, not {n}")
        held[seq_id] -= n
        if held[seq_id] == 0:
            del held[seq_id]
        self.free_blocks[server_id] += n

    def used(self, server_id: str) -> int:
        return self.capacity[server_id] - self.free_blocks[server_id]


@dataclass
class SimSeq:
    """A running sequence: its request, owner instance, rBlocks per server, and progress.

    ``computed`` = tokens whose KV exists (prompt prefilled so far, then one more per decoded token);
    its KV is spread over ``blocks`` in proportion to the rBlocks each server holds (an assumption: the
    attention work of a server is its share of the sequence's keys).
    """

    req: Request
    owner: int
    blocks: dict[str, int]
    computed: int = 0
    generated: int = 0
    migrating: bool = False

    @property
    def seq_id(self) -> str:
        return self.req.req_id

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks.values())

    @property
    def prefilling(self) -> bool:
        return self.computed < self.req.prompt_tokens

    def fraction(self, server_id: str) -> float:
        return self.blocks.get(server_id, 0) / self.num_blocks


class KVTokens:
    """KV tokens resident per server (all owners), and per instance the tokens of its sequences away from
    its home, per server: kept exact as sequences grow, finish and move."""

    def __init__(self, servers: list[str], homes: list[str]) -> None:
        self.on = dict.fromkeys(servers, 0.0)
        self.homes = homes
        self.away: list[dict[str, float]] = [{} for _ in homes]  # instance index -> server -> tokens

    def add(self, seq: SimSeq, tokens: float) -> None:
        """``seq`` gained (or, negative, lost) ``tokens`` of KV, spread over its servers."""
        home = self.homes[seq.owner]
        if len(seq.blocks) == 1 and home in seq.blocks:  # the common case: all at home
            self.on[home] += tokens
            return
        total = seq.num_blocks
        away = self.away[seq.owner]
        for server_id, n in seq.blocks.items():
            t = tokens * n / total
            self.on[server_id] += t
            if server_id != home:
                away[server_id] = away.get(server_id, 0.0) + t
                if away[server_id] <= 1e-6:
                    del away[server_id]


@dataclass
class Instance:
    """A simulated compute instance: FCFS queue, running batch, its home server, its last step time."""

    index: int
    instance_id: str
    home: str
    queue: deque[Request] = field(default_factory=deque)
    running: list[SimSeq] = field(default_factory=list)
    prefills: list[SimSeq] = field(default_factory=list)  # running sequences with prompt left, FCFS
    last_step_s: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=64))  # planner StepSamples
    idle: bool = False  # no step scheduled: nothing running or queued (an arrival wakes it)
