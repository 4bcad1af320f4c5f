"""DistAttention: block tables, the step split, fan-out to attention servers and the exact merge.

One class serves the single-process engine and the compute instance of the mesh (DESIGN.md §3). It owns
each sequence's block table (``[BlockRef(holder, block_id), ...]``; entry ``i`` covers tokens
``[i*block_size, (i+1)*block_size)``), grows it through a :class:`Placement` and reaches the holders of
the KV through an :class:`AttentionTransport`:

- a step is planned once: each holder of a step's sequences is told ``(seq_id, num_computed_tokens,
  num_new)`` per sequence (:class:`~infinite_llm.core.rmanager.SeqStep`) and builds its own plan from the
  rBlocks it recorded at commit; no block ids travel;
- each layer then sends each holder only its queries and the new K/V it stores, and gets back one partial
  output + lse, merged here exactly (PAPER.md DistAttention; vLLM ``merge_attn_states``).

Transports: in-process rManagers (``core/local_transport.py``), gRPC and torch.distributed
(``services/compute/``). Source of the shapes: vLLM v1 ``sched/output.py`` (full request data once, then
only changes) and ``kv_cache_manager.py`` (one allocation interface that hides where blocks are).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, NewType, Protocol

import torch

from infinite_llm.core.attention import merge_partials
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.prefix_cache import BlockHash, block_hashes, max_cache_hit_tokens
from infinite_llm.core.rmanager import SeqStep

HolderId = NewType("HolderId", str)  # an attention server id (or an in-process partition's name)
BlockId = NewType("BlockId", int)  # a physical rBlock id in its holder's pool
MergeFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Partial = tuple[torch.Tensor, torch.Tensor]  # (partial_out [n, H, D], lse [n, H] fp32)


class BlockRef(NamedTuple):
    """One block-table entry: which holder keeps the rBlock, and its id there."""

    holder: HolderId
    block_id: BlockId


@dataclass(frozen=True)
class LayerInput:
    """What one holder gets for one layer: ``query [num_tokens_here, H, D]`` (every new token of its
    sequences, in step order), ``key, value [num_new_here, Hkv, D]`` (only the new tokens it stores)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


class Placement(Protocol):
    """Where new rBlocks come from: in-process rManagers, or the global manager of the mesh."""

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def place(self, seq_id: str, n: int, first_index: int, near: HolderId | None = None) -> list[BlockRef] | None:
        """``n`` new rBlocks for logical indices ``first_index ..``, in table order; ``None`` (nothing
        changed) when they cannot be held now. ``near``: the holder of the sequence's last rBlock, preferred
        while it has room, so a sequence's KV stays on as few holders as it fits (fewer per-layer round
        trips); a placement may ignore it."""
        ...

    def release(self, seq_id: str, holders: Sequence[HolderId]) -> int:
        """Free every rBlock of ``seq_id`` (held on ``holders``); returns how many."""
        ...


class AttentionTransport(Protocol):
    """How a step reaches the holders. Every method raises the typed errors of ``core/errors.py``."""

    def open_step(
        self,
        step_id: int,
        plans: Mapping[HolderId, list[SeqStep]],
        num_heads: int,
        num_kv_rows: Mapping[HolderId, int] | None = None,
    ) -> None:
        """Tell each holder the sequences of a step it serves (it builds and keeps its plan).
        ``num_kv_rows``: per holder, the K/V rows each layer will store there (sizes fixed-size transports)."""
        ...

    def attend(self, step_id: int, layer: int, inputs: Mapping[HolderId, LayerInput]) -> dict[HolderId, Partial]:
        """One layer on every holder, concurrently; returns each holder's partial output and lse."""
        ...

    def close_step(self, step_id: int, failed: bool) -> None:
        """End a step (``failed``: cancel what is still in flight). Never raises."""
        ...


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

    def put(self, part: int, rows: torch.Tensor | None, partial_out: torch.Tensor, lse: torch.Tensor) -> None:
        """``rows [n]`` int64 on the buffer's device (``None``: every row); ``partial_out [n, H, D]``;
        ``lse [n, H]`` fp32."""
        if rows is None:
            self.outs[part].copy_(partial_out)
            self.lses[part].copy_(lse)
            return
        self.outs[part, rows] = partial_out.to(self.outs.device, self.outs.dtype)
        self.lses[part, rows] = lse.to(self.lses.device)

    def merged(self) -> torch.Tensor:
        """``[T, H, D]`` attention output of the step's queries."""
        if self.outs.shape[0] == 1:
            return self.outs[0]
        return self._merge(self.outs, self.lses)[0]


@dataclass(frozen=True)
class _HolderRows:
    """One holder's share of a step: its query rows and the rows of the new tokens it stores.

    ``None`` means every row of the step, in order (no gather needed).
    """

    query_rows: torch.Tensor | None
    new_rows: torch.Tensor | None


class StepAttention:
    """The attention callable of one step (``AttentionFn``): fan out per layer, merge. Close it after the
    step (``with``), so the holders drop their plans."""

    def __init__(
        self, owner: DistAttention, step_id: int, rows: dict[HolderId, _HolderRows], disjoint: bool = False
    ) -> None:
        self._owner = owner
        self.step_id = step_id
        self.rows = rows
        # Every query row is served by exactly one holder (each sequence's context lies on one server, as
        # the mesh's placement keeps it): the merge is then a scatter of the partial outputs, bit for bit
        # what the exact merge gives (weights exp(lse - lse) = 1 and 0).
        self.disjoint = disjoint
        self._closed = False

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` of the step's new tokens -> attention output ``[T, H, D]``."""
        return self._owner._attend(self, layer, q, k, v)

    def close(self, failed: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._owner.transport.close_step(self.step_id, failed)

    def __enter__(self) -> StepAttention:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        self.close(failed=exc_type is not None)


class DistAttention:
    """Block manager + attention backend over the holders a ``transport`` reaches.

    Args:
        placement: grows block tables (:class:`Placement`).
        transport: carries steps to the holders (:class:`AttentionTransport`).
        block_size: tokens per rBlock; the holders must agree (checked when they register).
        device: where the step's row indices live (the device of the queries).
        merge_fn: the exact merge (Triton on CUDA through the kernels dispatcher).
        prefix_cache_model_id: the model's id in the prefix cache's block hashes; ``None`` turns prefix
            caching off (also when the placement cannot share rBlocks: it has no ``match_prefix``).
    """

    def __init__(
        self,
        placement: Placement,
        transport: AttentionTransport,
        block_size: int,
        device: torch.device | str = "cpu",
        merge_fn: MergeFn = merge_partials,
        prefix_cache_model_id: str | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.placement = placement
        self.transport = transport
        self.block_size = block_size
        self.device = torch.device(device)
        self._merge = merge_fn
        self._tables: dict[str, list[BlockRef]] = {}
        self._spans: dict[str, dict[HolderId, _Span]] = {}  # per sequence: where each holder sits in its table
        self._step_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._released: dict[str, dict[HolderId, int]] = {}
        self.fan_out_seconds = 0.0  # wall time of every per-layer fan-out + merge (seconds)
        self.fan_out_count = 0
        can_share = hasattr(placement, "match_prefix")
        self.prefix_cache_model_id = prefix_cache_model_id if can_share else None
        self._hashes: dict[str, list[BlockHash]] = {}  # per sequence: hashes of its full blocks known so far
        self._published: dict[str, int] = {}  # per sequence: its first blocks that are in the index (or hits)
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # of those, tokens served from it (vLLM's prefix_cache_hits)
        # per sequence: (queries, hits) of a lookup not yet counted. A lookup counts once its sequence is
        # admitted (its first allocation): a head that waits for memory looks up again every step it tries.
        self._uncounted: dict[str, tuple[int, int]] = {}

    # ---- block manager -------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.placement.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.placement.num_free_blocks

    def block_table(self, seq_id: str) -> list[BlockRef]:
        return list(self._tables.get(seq_id, []))

    def try_allocate(self, seq_id: str, n: int) -> bool:
        """Append ``n`` rBlocks to ``seq_id``'s block table; False (nothing changes) when they do not fit."""
        table = self._tables.get(seq_id, [])
        refs = self.placement.place(seq_id, n, len(table), table[-1].holder if table else None)
        if refs is None:
            return False
        if len(refs) != n:
            raise InvalidRequest(f"placement returned {len(refs)} rBlocks for {n} asked for {seq_id!r}")
        _add_spans(self._spans.setdefault(seq_id, {}), refs, len(table))
        self._tables[seq_id] = table + refs
        queries, hits = self._uncounted.pop(seq_id, (0, 0))
        self.prefix_cache_queries += queries
        self.prefix_cache_hits += hits
        return True

    # ---- prefix cache ---------------------------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        return self.prefix_cache_model_id is not None

    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Start ``seq_id``'s empty block table with the longest cached prefix of ``token_ids`` (shared
        rBlocks, read only); returns the tokens it covers (a multiple of ``block_size``, at most
        ``len(token_ids) - 1``: the last token is always computed). 0 when prefix caching is off."""
        if not self.prefix_caching or not token_ids:
            return 0
        assert not self._tables.get(seq_id), f"sequence {seq_id!r} already has rBlocks"
        hashes = self._hashes[seq_id] = self._hash(token_ids, max_cache_hit_tokens(len(token_ids), self.block_size))
        refs = self.placement.match_prefix(seq_id, hashes) if hashes else []  # type: ignore[attr-defined]
        self._uncounted[seq_id] = (len(token_ids), len(refs) * self.block_size)
        self._published[seq_id] = len(refs)
        if refs:
            self._tables[seq_id] = list(refs)
            _add_spans(self._spans.setdefault(seq_id, {}), refs, 0)
        return len(refs) * self.block_size

    def cache_computed(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Publish the full rBlocks of ``seq_id`` whose KV the last step completed (the first
        ``num_computed_tokens`` of ``token_ids`` have KV); returns how many the index took."""
        if not self.prefix_caching:
            return 0
        table = self._tables.get(seq_id, [])
        known = self._hashes.setdefault(seq_id, [])
        full, done = min(num_computed_tokens // self.block_size, len(table)), self._published.get(seq_id, 0)
        if full <= done:
            return 0
        if len(known) < full:
            start = len(known) * self.block_size
            parent = known[-1] if known else None
            known.extend(self._hash(token_ids[start:], (full - len(known)) * self.block_size, parent))
        self._published[seq_id] = full
        return self.placement.publish(seq_id, [(i, known[i], table[i]) for i in range(done, full)])  # type: ignore[attr-defined]

    def flush_published(self) -> int:
        """Send what :meth:`cache_computed` queued (a placement that publishes once per step); returns how many."""
        flush = getattr(self.placement, "flush_published", None)
        return flush() if self.prefix_caching and flush is not None else 0

    def clear_prefix_cache(self) -> int:
        """Uncache every rBlock; those with no reader become free. Returns how many were cached."""
        return self.placement.clear_prefix_cache() if self.prefix_caching else 0  # type: ignore[attr-defined]

    @property
    def num_cached_blocks(self) -> int:
        return self.placement.num_cached_blocks if self.prefix_caching else 0  # type: ignore[attr-defined]

    def _hash(self, token_ids: Sequence[int], num_tokens: int, parent: BlockHash | None = None) -> list[BlockHash]:
        assert self.prefix_cache_model_id is not None
        return block_hashes(token_ids, self.block_size, self.prefix_cache_model_id, parent, num_tokens)

    def replace_table(self, seq_id: str, table: Sequence[BlockRef]) -> None:
        """Point ``seq_id`` at another block table of the same length (the flip that ends a migration: the
        new holders already recorded each rBlock's logical index at import). Takes effect at the next step."""
        old = self._tables.get(seq_id)
        if old is None or len(old) != len(table):
            raise InvalidRequest(f"sequence {seq_id!r}: a new block table must replace one of the same length")
        spans: dict[HolderId, _Span] = {}
        _add_spans(spans, table, 0)
        self._tables[seq_id], self._spans[seq_id] = list(table), spans

    def free(self, seq_id: str) -> int:
        """Free every rBlock of ``seq_id`` on every holder; returns the number freed (0 if none). A sequence
        with none ended while waiting: a placement that keeps claims of refused admissions (``drop_claim``,
        the manager's placement) drops its claim."""
        with self._lock:
            self._released[seq_id] = self.placement_of(seq_id)
            while len(self._released) > 1024:  # kept for pop_placement only: bounded
                self._released.pop(next(iter(self._released)))
        table = self._tables.pop(seq_id, [])
        holders = list(self._spans.pop(seq_id, {}))
        self._hashes.pop(seq_id, None)
        self._published.pop(seq_id, None)
        self._uncounted.pop(seq_id, None)
        if not table:  # it ended while waiting: a claim its refused admission left at the placement ends too
            drop_claim = getattr(self.placement, "drop_claim", None)
            if drop_claim is not None:
                drop_claim(seq_id)
            return 0
        return self.placement.release(seq_id, holders)

    def placement_of(self, seq_id: str) -> dict[HolderId, int]:
        """rBlocks per holder of ``seq_id``."""
        out: dict[HolderId, int] = {}
        for ref in self._tables.get(seq_id, []):
            out[ref.holder] = out.get(ref.holder, 0) + 1
        return out

    def pop_placement(self, seq_id: str) -> dict[HolderId, int]:
        """rBlocks per holder of ``seq_id``, live or at its last release (then forgotten). Thread-safe."""
        with self._lock:
            released = self._released.pop(seq_id, None)
        return released if released is not None else self.placement_of(seq_id)

    # ---- attention -----------------------------------------------------------------------------------
    def prepare(self, seqs: list[SeqStep], num_heads: int) -> StepAttention:
        """Plan one step (queries of ``seqs`` concatenated in order) on every holder; returns its attention.

        Raises :class:`InvalidRequest` when a block table is too short for its step.
        """
        plans = self.holder_plans(seqs)
        first_row: dict[str, int] = {}
        new_rows: dict[HolderId, list[int]] = {h: [] for h in plans}
        start = 0
        for s in seqs:
            first_row[s.seq_id] = start
            table = self._tables[s.seq_id]
            for row, pos in enumerate(range(s.num_computed_tokens, s.context_len), start=start):
                new_rows[table[pos // self.block_size].holder].append(row)
            start += s.num_new
        rows = {}
        num_query_rows = 0
        for h, planned in plans.items():
            query_rows = [r for p in planned for r in range(first_row[p.seq_id], first_row[p.seq_id] + p.num_new)]
            rows[h] = _HolderRows(self._index(query_rows, start), self._index(new_rows[h], start))
            num_query_rows += len(query_rows)
        step_id = next(self._step_ids)
        self.transport.open_step(step_id, plans, num_heads, {h: len(new_rows[h]) for h in plans})
        return StepAttention(self, step_id, rows, disjoint=num_query_rows == start)

    def holder_plans(self, seqs: list[SeqStep]) -> dict[HolderId, list[SeqStep]]:
        """The sequences of a step each holder serves (those with an rBlock below the step's context), in
        step order, each with ``num_blocks_here``: how many of those rBlocks the block table puts on that
        holder (the holder checks it against what it holds). Raises :class:`InvalidRequest` when a block
        table is too short for its step."""
        plans: dict[HolderId, list[SeqStep]] = {}
        for s in seqs:
            holders = self._holders_of_step(s)
            spans = self._spans[s.seq_id]
            beyond = self._tables[s.seq_id][-(-s.context_len // self.block_size) :]  # rBlocks past the step: few
            for holder in holders:
                n = spans[holder].count
                n -= sum(1 for ref in beyond if ref.holder == holder) if beyond else 0
                plans.setdefault(holder, []).append(SeqStep(s.seq_id, s.num_computed_tokens, s.num_new, n))
        return plans

    def _holders_of_step(self, s: SeqStep) -> list[HolderId]:
        """Holders of an rBlock below the step's context, in table order."""
        table = self._tables.get(s.seq_id, [])
        num_blocks = -(-s.context_len // self.block_size)
        if len(table) < num_blocks:
            raise InvalidRequest(f"sequence {s.seq_id!r} has {len(table)} rBlocks for {s.context_len} tokens")
        return [h for h, span in self._spans[s.seq_id].items() if span.first < num_blocks]

    def _index(self, rows: list[int], num_tokens: int) -> torch.Tensor | None:
        if len(rows) == num_tokens:  # rows are ascending and distinct: every row, in order
            return None
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _attend(
        self, step: StepAttention, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Fan out to every holder of the step, then merge: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]``."""
        started = time.perf_counter()
        inputs = {
            h: LayerInput(_take(q, r.query_rows), _take(k, r.new_rows), _take(v, r.new_rows))
            for h, r in step.rows.items()
        }
        partials = self.transport.attend(step.step_id, layer, inputs)
        if len(step.rows) == 1:
            ((holder, rows),) = step.rows.items()
            if rows.query_rows is None:  # one holder saw every query: its partial is the attention
                out = partials[holder][0].to(device=q.device, dtype=q.dtype)
                self._count(started)
                return out
        if step.disjoint:  # each row has one partial: place it (no lse needed)
            out = torch.empty_like(q)
            for holder, rows in step.rows.items():
                partial_out = partials[holder][0].to(device=q.device, dtype=q.dtype)
                if rows.query_rows is None:
                    out.copy_(partial_out)
                else:
                    out.index_copy_(0, rows.query_rows, partial_out)
            self._count(started)
            return out
        buffer = PartialsBuffer(len(step.rows), q, self._merge)
        for j, (holder, rows) in enumerate(step.rows.items()):
            buffer.put(j, rows.query_rows, *partials[holder])
        out = buffer.merged()
        self._count(started)
        return out

    def _count(self, started: float) -> None:
        self.fan_out_seconds += time.perf_counter() - started
        self.fan_out_count += 1


@dataclass
class _Span:
    """Where one holder sits in a sequence's block table: its lowest logical index (``first``) and how many
    of the table's rBlocks it holds (``count``)."""

    first: int
    count: int = 0


def _add_spans(spans: dict[HolderId, _Span], refs: Sequence[BlockRef], start: int) -> None:
    """Count ``refs`` (table entries from logical index ``start`` on) into ``spans``."""
    for i, ref in enumerate(refs, start=start):
        spans.setdefault(ref.holder, _Span(first=i)).count += 1


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)
