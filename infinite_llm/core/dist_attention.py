"""DistAttention over several rManagers in one process: placement, block tables, fan-out and exact merge.

The single-process engine's attention backend. Every attention goes through partition + merge: each
partition (holder) computes a partial output and lse over its own rBlocks of each sequence, and the
partials are merged exactly (PAPER.md DistAttention; DESIGN.md §3). With one partition this is plain paged
attention. The compute instance of the mesh does the same with holders behind gRPC.

A block table entry is ``(holder_id, block_id)``; entry ``i`` covers tokens ``[i*block_size, (i+1)*block_size)``.
Placement puts each new rBlock on the holder with the most free blocks (lowest id on ties), the paper's
"creditor with the most free memory" rule.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from infinite_llm.core.attention import merge_partials
from infinite_llm.core.errors import CapacityExhausted, InvalidRequest
from infinite_llm.core.model import AttentionFn
from infinite_llm.core.rmanager import HolderSeqStep, RManager, StepPlan

BlockTableEntry = tuple[int, int]  # (holder_id, block_id); a remote holder id is a server id string
H = TypeVar("H", bound=Hashable)  # a holder id: partition index or server id
MergeFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SeqStepInput:
    """One scheduled sequence of a step: ``num_new`` tokens starting at position ``num_computed``."""

    seq_id: str
    num_computed: int
    num_new: int


class PartialsBuffer:
    """The per-holder partials of one layer of a step, merged exactly into the attention output.

    Row ``rows`` of part ``j`` receive that holder's ``partial_out`` / ``lse``; rows a holder did not compute
    keep ``lse = -inf`` (weight 0). One part is returned as is (a merge of one part is the identity).
    """

    def __init__(self, num_parts: int, like: torch.Tensor, merge_fn: MergeFn = merge_partials) -> None:
        t, h, d = like.shape  # like: the step's queries [T, H, D]
        self.outs = torch.zeros(num_parts, t, h, d, dtype=like.dtype, device=like.device)
        self.lses = torch.full((num_parts, t, h), float("-inf"), dtype=torch.float32, device=like.device)
        self._merge = merge_fn

    def put(self, part: int, rows: torch.Tensor, partial_out: torch.Tensor, lse: torch.Tensor) -> None:
        """``rows [n]`` int64; ``partial_out [n, H, D]``; ``lse [n, H]`` fp32."""
        self.outs[part, rows] = partial_out.to(self.outs.device, self.outs.dtype)
        self.lses[part, rows] = lse.to(self.lses.device)

    def merged(self) -> torch.Tensor:
        """``[T, H, D]`` attention output of the step's queries."""
        if self.outs.shape[0] == 1:
            return self.outs[0]
        return self._merge(self.outs, self.lses)[0]


class LocalDistAttention:
    """Block manager + attention backend over ``holders`` (one rManager per partition)."""

    def __init__(self, holders: list[RManager], merge_fn: MergeFn = merge_partials) -> None:
        if not holders:
            raise ValueError("need at least one holder")
        sizes = {h.layout.block_size for h in holders}
        if len(sizes) != 1:
            raise ValueError(f"holders disagree on block_size: {sorted(sizes)}")
        self.holders = holders
        self.block_size = sizes.pop()
        self._merge = merge_fn
        self._tables: dict[str, list[BlockTableEntry]] = {}

    # ---- block manager -------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return sum(h.pool.num_blocks for h in self.holders)

    @property
    def num_free_blocks(self) -> int:
        return sum(h.pool.num_free for h in self.holders)

    def block_table(self, seq_id: str) -> list[BlockTableEntry]:
        return list(self._tables.get(seq_id, []))

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, seq_id: str, n: int) -> list[BlockTableEntry]:
        """Append ``n`` rBlocks to ``seq_id``'s block table, each on the holder with the most free blocks."""
        if not self.can_allocate(n):
            raise CapacityExhausted(f"need {n} rBlocks, {self.num_free_blocks} free over {len(self.holders)} holders")
        free = [h.pool.num_free for h in self.holders]
        counts = [0] * len(self.holders)
        order: list[int] = []
        for _ in range(n):
            p = max(range(len(free)), key=lambda i: (free[i], -i))
            free[p] -= 1
            counts[p] += 1
            order.append(p)
        fresh = {p: iter(self.holders[p].allocate(seq_id, c)) for p, c in enumerate(counts) if c}
        entries = [(p, next(fresh[p])) for p in order]
        self._tables.setdefault(seq_id, []).extend(entries)
        return entries

    def try_allocate(self, seq_id: str, n: int) -> bool:
        """All-or-nothing :meth:`allocate`; False when too few blocks are free (nothing changes)."""
        if not self.can_allocate(n):
            return False
        self.allocate(seq_id, n)
        return True

    def free(self, seq_id: str) -> int:
        """Free every rBlock of ``seq_id`` on every holder; returns the number freed."""
        self._tables.pop(seq_id, None)
        return sum(h.free_sequence(seq_id) for h in self.holders)

    # ---- attention -----------------------------------------------------------------------------------
    def prepare(self, seqs: list[SeqStepInput]) -> AttentionFn:
        """Plan one step (queries of ``seqs`` concatenated in order) and return its attention callable."""
        # (holder, plan, query rows in the step, step rows of the new tokens it stores)
        plans: list[tuple[int, StepPlan, torch.Tensor, torch.Tensor]] = []
        per_holder: dict[int, list[HolderSeqStep]] = {}
        rows_of: dict[int, list[int]] = {}
        start = 0
        for s in seqs:
            for p, item in split_step(self._tables.get(s.seq_id, []), self.block_size, s).items():
                per_holder.setdefault(p, []).append(item)
                rows_of.setdefault(p, []).extend(range(start, start + s.num_new))
            start += s.num_new
        for p in sorted(per_holder):
            plan = self.holders[p].plan_step(per_holder[p])
            rows = torch.tensor(rows_of[p], dtype=torch.int64)
            plans.append((p, plan, rows, rows[plan.new_token_rows]))
        return lambda layer, q, k, v: self._attend(layer, plans, q, k, v)

    def _attend(
        self,
        layer: int,
        plans: list[tuple[int, StepPlan, torch.Tensor, torch.Tensor]],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Fan out to every holder of the step, then merge: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]``."""
        partials = PartialsBuffer(len(plans), q, self._merge)
        for j, (p, plan, rows, new_rows) in enumerate(plans):
            out_p, lse_p = self.holders[p].attend(layer, plan, q[rows], k[new_rows], v[new_rows])
            partials.put(j, rows, out_p, lse_p)
        return partials.merged()


def split_step(table: Sequence[tuple[H, int]], block_size: int, s: SeqStepInput) -> dict[H, HolderSeqStep]:
    """Cut one sequence's step into per-holder items by its block table ``[(holder, block_id), ...]``.

    Every holder of a block covering ``[0, num_computed + num_new)`` gets all of the step's queries (its
    keys are part of every query's context) and the new tokens whose slots it holds. Raises
    :class:`InvalidRequest` when the table is too short for the step.
    """
    context_len = s.num_computed + s.num_new
    if len(table) * block_size < context_len:
        raise InvalidRequest(f"sequence {s.seq_id!r} has {len(table)} rBlocks for {context_len} tokens")
    positions = list(range(s.num_computed, context_len))
    blocks: dict[H, tuple[list[int], list[int]]] = {}
    for i, (p, b) in enumerate(table[: -(-context_len // block_size)]):
        ids, idx = blocks.setdefault(p, ([], []))
        ids.append(b)
        idx.append(i)
    new: dict[H, tuple[list[int], list[int]]] = {}
    for row, pos in enumerate(positions):
        p, b = table[pos // block_size]
        slots, rows = new.setdefault(p, ([], []))
        slots.append(b * block_size + pos % block_size)
        rows.append(row)
    return {
        p: HolderSeqStep(s.seq_id, positions, context_len, ids, idx, *new.get(p, ([], [])))
        for p, (ids, idx) in blocks.items()
    }
