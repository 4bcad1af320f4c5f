"""DistAttention's in-process holders: placement over and transport to rManagers of this process.

The single-process engine computes every attention as partition + merge over ``num_partitions`` of these
(DESIGN.md §3), so it is the reference the mesh's gRPC and torch.distributed transports are checked
against. Placement puts each new rBlock on the holder with the most free blocks (the first on ties), the
paper's "creditor with the most free memory" rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from infinite_llm.core.dist_attention import BlockId, BlockRef, HolderId, LayerInput, Partial
from infinite_llm.core.prefix_cache import BlockHash
from infinite_llm.core.rmanager import RManager, SeqStep, StepPlan


def partition_id(p: int) -> HolderId:
    """Holder id of in-process partition ``p``."""
    return HolderId(f"partition-{p}")


class LocalPlacement:
    """Most-free placement over in-process rManagers (ties go to the earlier holder)."""

    def __init__(self, holders: Mapping[HolderId, RManager]) -> None:
        if not holders:
            raise ValueError("need at least one holder")
        sizes = {h.layout.block_size for h in holders.values()}
        if len(sizes) != 1:
            raise ValueError(f"holders disagree on block_size: {sorted(sizes)}")
        self.holders = dict(holders)

    @property
    def num_total_blocks(self) -> int:
        return sum(h.pool.num_blocks for h in self.holders.values())

    @property
    def num_free_blocks(self) -> int:
        return sum(h.pool.num_free for h in self.holders.values())

    def place(self, seq_id: str, n: int, first_index: int, near: HolderId | None = None) -> list[BlockRef] | None:
        """``n`` rBlocks, each on the holder with the most free blocks at that point; ``None`` if too few.
        ``near`` is ignored: the single-process engine spreads every sequence over its partitions on purpose,
        so that every step exercises the exact merge (DistAttention's correctness reference)."""
        if n > self.num_free_blocks:
            return None
        ids = list(self.holders)
        free = [self.holders[h].pool.num_free for h in ids]
        order: list[int] = []
        for _ in range(n):
            p = max(range(len(free)), key=lambda i: (free[i], -i))
            free[p] -= 1
            order.append(p)
        indices: dict[int, list[int]] = {}
        for i, p in enumerate(order, start=first_index):
            indices.setdefault(p, []).append(i)
        fresh = {p: iter(self.holders[ids[p]].allocate(seq_id, idx)) for p, idx in indices.items()}
        return [BlockRef(ids[p], BlockId(next(fresh[p]))) for p in order]

    def release(self, seq_id: str, holders: Sequence[HolderId]) -> int:
        return sum(self.holders[h].free_sequence(seq_id) for h in holders)

    # ---- prefix cache: each holder indexes its own cached rBlocks; the longest chain may span holders ----
    def match_prefix(self, seq_id: str, hashes: Sequence[BlockHash]) -> list[BlockRef]:
        """The longest prefix of ``hashes`` cached on the holders, attached to ``seq_id`` at logical
        indices ``0..`` (one reader more each); ``[]`` on a miss."""
        found: list[HolderId] = []
        for h in hashes:
            holder = next((hid for hid, rm in self.holders.items() if rm.cached_block(h) is not None), None)
            if holder is None:
                break
            found.append(holder)
        by_holder: dict[HolderId, list[int]] = {}
        for i, holder in enumerate(found):
            by_holder.setdefault(holder, []).append(i)
        ids = {
            holder: iter(self.holders[holder].attach(seq_id, idx, [hashes[i] for i in idx]))
            for holder, idx in by_holder.items()
        }
        return [BlockRef(holder, BlockId(next(ids[holder]))) for holder in found]

    def publish(self, seq_id: str, blocks: Sequence[tuple[int, BlockHash, BlockRef]]) -> int:
        """Index full rBlocks of ``seq_id`` (``(logical index, hash, where)``); returns how many are new."""
        by_holder: dict[HolderId, list[tuple[int, BlockHash]]] = {}
        for i, h, ref in blocks:
            if any(rm.cached_block(h) is not None for rm in self.holders.values()):
                continue  # one copy per hash in the whole index (another sequence computed it too)
            by_holder.setdefault(ref.holder, []).append((i, h))
        return sum(len(self.holders[hid].cache_blocks(seq_id, entries)) for hid, entries in by_holder.items())

    def clear_prefix_cache(self) -> int:
        """Uncache every rBlock (those with no reader become free); returns how many were cached."""
        return sum(rm.clear_cache() for rm in self.holders.values())

    @property
    def num_cached_blocks(self) -> int:
        return sum(rm.num_cached_blocks for rm in self.holders.values())


class LocalTransport:
    """Steps on in-process rManagers: the plan is built at open, each layer calls ``RManager.attend``."""

    def __init__(self, holders: Mapping[HolderId, RManager]) -> None:
        self.holders = dict(holders)
        self._plans: dict[int, dict[HolderId, StepPlan]] = {}

    def open_step(
        self,
        step_id: int,
        plans: Mapping[HolderId, list[SeqStep]],
        num_heads: int,
        num_kv_rows: Mapping[HolderId, int] | None = None,
    ) -> None:
        self._plans[step_id] = {h: self.holders[h].plan_step(seqs) for h, seqs in plans.items()}

    def attend(self, step_id: int, layer: int, inputs: Mapping[HolderId, LayerInput]) -> dict[HolderId, Partial]:
        plans = self._plans[step_id]
        return {h: self.holders[h].attend(layer, plans[h], x.query, x.key, x.value) for h, x in inputs.items()}

    def close_step(self, step_id: int, failed: bool) -> None:
        self._plans.pop(step_id, None)
