"""The compute instance's half of a live migration: move a running sequence's rBlocks between its steps.

The manager orders a move (:mod:`infinite_llm.services.manager.migrations`: the destination is reserved,
one reservation per rBlock, and the ledger updated); the heartbeat reply brings the order here. The copy
overlaps the steps; only the switch happens between two of them. :meth:`MigrationExecutor.between_steps`
(engine thread) starts, on a worker thread, the copy of at most ``tokens_per_step // block_size`` rBlocks
(at least one; ``--migration-tokens-per-step``, default 16; an order off a draining server, which must empty
before a deadline, ``--drain-tokens-per-step``, default 256): one ExportBlocks of them from the source, one
ImportBlocks into their reservations on the destination, *staged* (written, still reserved, read by no
step). At the next call, if the copy is done (normally long before: it ran during the step; else at a
later call, the source serving meanwhile, so the budget is a ceiling that a slow copy lowers), it commits
each staged rBlock at its logical index (CommitBlocks), frees those indices on the source (one
FreeSequence), flips those entries of the block table (:meth:`DistAttention.replace_table`), and starts the
next copy. No step runs between a commit and the flip, so no step sees an rBlock twice or not at all: the
old copy serves every step until the flip. Only full rBlocks move (below ``num_computed_tokens //
block_size``): their KV never changes again. Any failure stops the order and leaves the source
authoritative for what did not move (a committed copy whose source could not be freed is freed on the
destination instead); the manager settles the rest from the :class:`MigrationResult` (sent with the next
heartbeat) and cancels the reservations not committed, staged ones included.

Shared rBlocks (prefix caching, issue 13) move with all their readers. The export carries the hash a block
is cached under and the destination caches its copy under it; the result lists those hashes, and the
manager then gives every other reader of the source copy a *re-attach* order (``block_indices`` set, one
reservation holding a reference to the destination's cached copy of each). Between two steps the reader's
instance commits that reservation at those indices (CommitBlocks), frees its source references (one
FreeSequence) and flips the entries, all or nothing: an entry no longer on the source (it moved meanwhile)
ends the order with nothing done, and the manager cancels the reservation. Each reader drops only its own
reference, so no block is freed while read, and no step sees a table the servers do not hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from infinite_llm.core.dist_attention import BlockId, BlockRef, DistAttention, HolderId
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.errors import describe_rpc_error

log = logging.getLogger(__name__)
MAX_WAIT_STEPS = 256  # steps an order may wait for its rBlocks to fill before it gives up


@dataclass(frozen=True)
class Staged:
    """One rBlock copied to the destination and left reserved there (``stage``), not yet committed."""

    index: int  # logical index in the sequence's block table
    source: BlockRef  # the entry it was copied from (the switch checks it is still the one in the table)
    reservation_id: int
    nbytes: int


@dataclass
class Copy:
    """What a copy started by :meth:`MigrationExecutor.between_steps` staged, in reservation order, and
    why it stopped early (``""``: it staged all it was given)."""

    staged: list[Staged] = field(default_factory=list)
    error: str = ""


@dataclass
class Order:
    """A :class:`~infinite_llm.pb.v1.manager_pb2.MigrationOrder` being executed, and how far it got."""

    migration_id: int
    seq_id: str
    src: str
    src_address: str
    dst: str
    dst_address: str
    reservation_ids: list[int]
    block_indices: list[int] = field(default_factory=list)  # a re-attach: the entries to flip
    moved: int = 0
    bytes_moved: int = 0
    waited: int = 0
    error: str = ""
    cached_hashes: list[bytes] = field(default_factory=list)  # moved shared rBlocks now cached on dst
    copying: Future[Copy] | None = None  # the copy running during the current step
    drain: bool = False  # the source is draining: copy at the drain budget

    @property
    def num_blocks(self) -> int:
        return len(self.block_indices) or len(self.reservation_ids)


@dataclass(frozen=True)
class MigrationResult:
    migration_id: int
    seq_id: str
    src: str
    dst: str
    num_blocks: int
    num_moved: int
    bytes_moved: int
    error: str
    cached_hashes: tuple[bytes, ...] = ()
    block_indices: tuple[int, ...] = ()


class MigrationExecutor:
    """Executes migration orders between the steps of one compute instance. ``offer``/``take_results`` are
    thread-safe; ``between_steps`` runs on the engine thread only; copies run on one worker thread.

    Args:
        dist: the instance's DistAttention (owner of the block tables).
        computed: ``seq_id -> num_computed_tokens`` of a running sequence, ``None`` when it is not running.
        tokens_per_step: the migration budget per step (tokens); ``block_size`` divides it into rBlocks.
        timeout_s: deadline of each RPC (seconds).
        drain_tokens_per_step: the budget of an order whose source is draining (``Order.drain``: a server
            stopping, or scaled down, empties before a deadline); default ``tokens_per_step``.
        on_paced: told, after each call of ``between_steps`` that worked on an order (a copy in flight, started
            or switched; not one that only waits for rBlocks to fill), the seconds that call spent and the
            seconds of the step run since the previous such call (0 when there was none just before): their
            ratio is what migration costs the engine thread while it lasts (PAPER.md: 8.6% of throughput at 32
            tokens per step). What the copy running beside a step costs that step shows in the step's own time.
    """

    def __init__(
        self,
        dist: DistAttention,
        computed: Callable[[str], int | None],
        tokens_per_step: int = 16,
        timeout_s: float = 30.0,
        on_paced: Callable[[float, float], None] | None = None,
        drain_tokens_per_step: int | None = None,
    ) -> None:
        drain_tokens_per_step = tokens_per_step if drain_tokens_per_step is None else drain_tokens_per_step
        if min(tokens_per_step, drain_tokens_per_step) < 1:
            raise ValueError(
                f"migration tokens per step must be >= 1, got {tokens_per_step} (drain {drain_tokens_per_step})"
            )
        self.dist, self._computed = dist, computed
        self.blocks_per_step = max(1, tokens_per_step // dist.block_size)
        self.drain_blocks_per_step = max(1, drain_tokens_per_step // dist.block_size)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._queue: list[Order] = []
        self._results: list[MigrationResult] = []
        self._channels: dict[str, grpc.Channel] = {}  # address -> channel (opened on the engine thread)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="migration-copy")
        self.migrations_total = 0
        self._on_paced = on_paced
        self._last_done: float | None = None  # when the previous call that worked on an order returned
        self.on_offer: Callable[[], None] | None = None  # told after each offer (wakes an idle engine thread)

    def offer(self, order: Order) -> None:
        with self._lock:
            self._queue.append(order)
        if self.on_offer is not None:
            self.on_offer()

    def flush(self) -> None:
        """Wait until the copy in flight, if any, is done (it is switched at the next call)."""
        self._copier.submit(lambda: None).result()  # one worker: runs after the copy

    def settle_idle(self) -> None:
        """Engine thread, while no sequence runs: end every queued order (each one's sequence is no longer
        running), once its copy in flight, if any, is done."""
        with self._lock:
            pending = len(self._queue)
        for _ in range(pending):
            self.between_steps()

    def close(self) -> None:
        """At shutdown, after the engine thread stopped: the copy in flight, if any, runs to its end (its staged
        rBlocks stay reserved, unread, until the reservation expires on the destination); none starts after."""
        self._copier.shutdown(wait=False, cancel_futures=True)

    def take_results(self) -> list[MigrationResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue)

    def between_steps(self) -> None:
        """Switch the first order's rBlocks copied during the last step, start copying its next ones; end
        the order when all moved or it failed."""
        with self._lock:
            order = self._queue[0] if self._queue else None
        if order is None:
            self._last_done = None
            return
        started, moved, copying = time.perf_counter(), order.moved, order.copying is not None
        try:
            self._advance(order)
        except grpc.RpcError as e:
            order.error = describe_rpc_error(e)
        except Exception as e:  # noqa: BLE001 - a failed migration must never fail the step loop
            log.exception("migration %d failed", order.migration_id)
            order.error = repr(e)
        if order.error and order.copying is not None:  # never report while a copy may still land
            order.copying.result()
            order.copying = None
        if order.error or order.moved == order.num_blocks:
            self._finish(order)
        done = time.perf_counter()
        working = copying or order.copying is not None or order.moved > moved  # not only waiting for rBlocks
        if self._on_paced is not None and working:
            self._on_paced(done - started, 0.0 if self._last_done is None else started - self._last_done)
        self._last_done = done if working else None

    def _advance(self, order: Order) -> None:
        computed = self._computed(order.seq_id)
        if order.copying is not None:
            if computed is not None and not order.copying.done():
                return  # slower than the step (a fast accelerator step): the source serves on, switch later
            copy, order.copying = order.copying.result(), None
            if computed is not None:
                self._switch(order, copy)
        if computed is None:
            order.error = "the sequence is no longer running"
            return
        if order.block_indices:
            self._reattach(order)
            return
        if order.error or order.moved == order.num_blocks:
            return
        table = self.dist.block_table(order.seq_id)
        full = computed // self.dist.block_size
        movable = [i for i, ref in enumerate(table[:full]) if ref.holder == order.src]
        if not movable:
            order.waited += 1
            if order.waited > MAX_WAIT_STEPS:
                order.error = f"no full rBlock of the sequence on {order.src} after {MAX_WAIT_STEPS} steps"
            return
        left = order.reservation_ids[order.moved :]
        budget = self.drain_blocks_per_step if order.drain else self.blocks_per_step
        picks = [(i, table[i], rid) for i, rid in zip(movable[:budget], left, strict=False)]
        src, dst = self._stub(order.src_address), self._stub(order.dst_address)
        order.copying = self._copier.submit(self._copy, order.seq_id, src, dst, picks)

    def _copy(
        self,
        seq_id: str,
        src: agrpc.AttentionServerStub,
        dst: agrpc.AttentionServerStub,
        picks: list[tuple[int, BlockRef, int]],
    ) -> Copy:
        """Worker thread: stage every ``(index, source entry, reservation id)`` on the destination, all in one
        ExportBlocks and one ImportBlocks (all or none; the manager cancels the reservations never committed)."""
        copy = Copy()
        try:
            request = apb.ExportBlocksRequest(seq_id=seq_id, block_ids=[int(ref.block_id) for _, ref, _ in picks])
            chunks = list(src.ExportBlocks(request, timeout=self.timeout_s))
            exported = list(chunks[0].header.block_indices)
            if exported != [index for index, _, _ in picks]:  # the source's table is not ours: move nothing
                copy.error = f"the source holds those rBlocks at indices {exported}, not {[i for i, _, _ in picks]}"
                return copy
            chunks[0].header.reservation_ids[:] = [reservation_id for _, _, reservation_id in picks]
            chunks[0].header.stage = True
            dst.ImportBlocks(iter(chunks), timeout=self.timeout_s)
            nbytes = sum(len(c.data) for c in chunks[1:]) // len(picks)
            copy.staged = [Staged(index, ref, reservation_id, nbytes) for index, ref, reservation_id in picks]
        except grpc.RpcError as e:
            copy.error = describe_rpc_error(e)
        except Exception as e:  # noqa: BLE001 - reported with the order's result
            log.exception("copying rBlocks of %s failed", seq_id)
            copy.error = repr(e)
        return copy

    def _switch(self, order: Order, copy: Copy) -> None:
        """Engine thread, between two steps: commit the staged rBlocks on the destination (in reservation
        order, up to the first that fails), free them on the source, flip their entries. A source that
        refuses the free keeps serving them: the destination's copies are freed again."""
        table = self.dist.block_table(order.seq_id)
        dst = self._stub(order.dst_address)
        error, committed = copy.error, []
        for s in copy.staged:
            if s.index >= len(table) or table[s.index] != s.source:
                error = f"rBlock {s.index} of the sequence changed while it was copied"
                break
            request = apb.CommitBlocksRequest(reservation_id=s.reservation_id, block_indices=[s.index])
            try:
                committed.append((s, dst.CommitBlocks(request, timeout=self.timeout_s)))
            except grpc.RpcError as e:
                error = describe_rpc_error(e)
                if e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                    self._drop_quietly(dst, order.seq_id, s.index)  # it may have committed before the reply was lost
                break
        if committed:
            indices = [s.index for s, _ in committed]
            free = apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=indices)
            try:
                self._stub(order.src_address).FreeSequence(free, timeout=self.timeout_s)
            except grpc.RpcError:  # the source still serves them: drop the new copies so no step reads two
                dst.FreeSequence(apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=indices),
                                 timeout=self.timeout_s)  # fmt: skip
                raise
            self._flip(order, indices, [reply.block_ids[0] for _, reply in committed])
            order.moved += len(committed)
            order.bytes_moved += sum(s.nbytes for s, _ in committed)
            for _, reply in committed:
                order.cached_hashes.extend(reply.cached_hashes)
        if error:
            order.error = error

    def _drop_quietly(self, dst: agrpc.AttentionServerStub, seq_id: str, index: int) -> None:
        """Best effort: free ``index`` of ``seq_id`` on the destination, if a commit whose reply was lost did
        put it there (no step ran since, so none read it). Refused when it is not there: nothing to do."""
        try:
            dst.FreeSequence(apb.FreeSequenceRequest(seq_id=seq_id, block_indices=[index]), timeout=self.timeout_s)
        except grpc.RpcError:
            pass

    def _reattach(self, order: Order) -> None:
        """Commit the order's reservation on the destination at its indices, free the source references of
        those indices, flip the table; if the source refuses the free, the destination's are freed again. An
        entry no longer on the source ends the order with nothing done (the manager cancels the reservation)."""
        table = self.dist.block_table(order.seq_id)
        stray = [i for i in order.block_indices if i >= len(table) or table[i].holder != order.src]
        if stray:
            order.error = f"rBlock {stray[0]} of the sequence is no longer on {order.src}"
            return
        src, dst = self._stub(order.src_address), self._stub(order.dst_address)
        (reservation_id,) = order.reservation_ids
        commit = apb.CommitBlocksRequest(reservation_id=reservation_id, block_indices=order.block_indices)
        ids = dst.CommitBlocks(commit, timeout=self.timeout_s).block_ids
        try:
            src.FreeSequence(
                apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=order.block_indices), timeout=self.timeout_s
            )
        except grpc.RpcError:  # the source still serves them: drop the destination's again
            dst.FreeSequence(
                apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=order.block_indices), timeout=self.timeout_s
            )
            raise
        self._flip(order, order.block_indices, ids)
        order.moved = len(order.block_indices)

    def _flip(self, order: Order, indices: Sequence[int], block_ids: Sequence[int]) -> None:
        """Point the block-table entries ``indices`` of the order's sequence at ``block_ids`` on ``order.dst``."""
        learn = getattr(self.dist.placement, "learn_address", None)
        if learn is not None:
            learn(HolderId(order.dst), order.dst_address)
        table = self.dist.block_table(order.seq_id)
        for index, block_id in zip(indices, block_ids, strict=True):
            table[index] = BlockRef(HolderId(order.dst), BlockId(int(block_id)))
        self.dist.replace_table(order.seq_id, table)

    def _stub(self, address: str) -> agrpc.AttentionServerStub:
        """A stub on a channel kept while orders run (engine thread only; closed when the queue empties)."""
        if address not in self._channels:
            self._channels[address] = sync_channel(address)
        return agrpc.AttentionServerStub(self._channels[address])

    def _finish(self, order: Order) -> None:
        result = MigrationResult(
            order.migration_id,
            order.seq_id,
            order.src,
            order.dst,
            order.num_blocks,
            order.moved,
            order.bytes_moved,
            order.error,
            tuple(order.cached_hashes),
            tuple(order.block_indices),
        )
        with self._lock:
            self._queue.remove(order)
            self._results.append(result)
            if order.moved:
                self.migrations_total += 1
            idle = not self._queue
        if idle:  # no order left: let the channels go
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        if order.error:
            log.warning("migration %d of %s stopped after %d rBlocks: %s", order.migration_id, order.seq_id,
                        order.moved, order.error)  # fmt: skip
