"""The compute instance's half of a live migration: move a running sequence's rBlocks between its steps.

The manager orders a move (:mod:`infinite_llm.services.manager.migrations`: the destination is reserved,
one reservation per rBlock, and the ledger updated); the heartbeat reply brings the order here. Between two
decode steps, on the engine thread, :meth:`MigrationExecutor.between_steps` moves at most
``tokens_per_step // block_size`` rBlocks (at least one; ``--migration-tokens-per-step``, default 16), each
one as: ExportBlocks of that rBlock from the source, ImportBlocks into one reservation on the destination
(it commits there at the same logical index), FreeSequence of that index on the source, then the flip of
that entry of the block table (:meth:`DistAttention.replace_table`). No step runs in between, so no step
sees the rBlock twice or not at all: the old copy serves every step until the flip. Only full rBlocks move
(below ``num_computed_tokens // block_size``): their KV never changes again. Any failure stops the order and
leaves the source authoritative for what did not move (a committed copy whose source could not be freed is
freed on the destination instead); the manager settles the rest from the :class:`MigrationResult` (sent
with the next heartbeat).

Shared rBlocks (prefix caching, issue 13) move with all their readers. The export carries the hash a block
is cached under and the destination caches its copy under it; the result lists those hashes, and the
manager then gives every other reader of the source copy a *re-attach* order (``block_indices`` set, no
reservations): the manager has already attached the destination's copy to that reader at the same logical
index, so its instance frees its source reference of those indices (one FreeSequence) and flips the
entries to the destination's blocks, between two steps like a move. No other reader's table changes before
its own order, and no block is freed while read: each reader drops its own reference only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from infinite_llm.core.dist_attention import BlockId, BlockRef, DistAttention, HolderId
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.channels import sync_channel

log = logging.getLogger(__name__)
MAX_WAIT_STEPS = 256  # steps an order may wait for its rBlocks to fill before it gives up


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
    dst_block_ids: list[int] = field(default_factory=list)  # ... to these blocks (attached already)
    moved: int = 0
    bytes_moved: int = 0
    waited: int = 0
    error: str = ""
    cached_hashes: list[bytes] = field(default_factory=list)  # moved shared rBlocks now cached on dst
    done: bool = field(default=False)

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
    thread-safe; ``between_steps`` runs on the engine thread only.

    Args:
        dist: the instance's DistAttention (owner of the block tables).
        computed: ``seq_id -> num_computed_tokens`` of a running sequence, ``None`` when it is not running.
        tokens_per_step: the migration budget per step (tokens); ``block_size`` divides it into rBlocks.
    """

    def __init__(
        self,
        dist: DistAttention,
        computed: Callable[[str], int | None],
        tokens_per_step: int = 16,
        timeout_s: float = 30.0,
    ) -> None:
        if tokens_per_step < 1:
            raise ValueError(f"migration tokens per step must be >= 1, got {tokens_per_step}")
        self.dist, self._computed = dist, computed
        self.blocks_per_step = max(1, tokens_per_step // dist.block_size)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._queue: list[Order] = []
        self._results: list[MigrationResult] = []
        self._channels: dict[str, grpc.Channel] = {}  # address -> channel (engine thread only)
        self.migrations_total = 0

    def offer(self, order: Order) -> None:
        with self._lock:
            self._queue.append(order)

    def take_results(self) -> list[MigrationResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue)

    def between_steps(self) -> None:
        """Move up to ``blocks_per_step`` rBlocks of the first order; end it when done or failed."""
        with self._lock:
            order = self._queue[0] if self._queue else None
        if order is None:
            return
        try:
            self._advance(order)
        except grpc.RpcError as e:
            order.error = f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 - a failed migration must never fail the step loop
            log.exception("migration %d failed", order.migration_id)
            order.error = repr(e)
        if order.error or order.moved == order.num_blocks:
            self._finish(order)

    def _advance(self, order: Order) -> None:
        computed = self._computed(order.seq_id)
        if computed is None:
            order.error = "the sequence is no longer running"
            return
        if order.block_indices:
            self._reattach(order)
            return
        table = self.dist.block_table(order.seq_id)
        full = computed // self.dist.block_size
        movable = [i for i, ref in enumerate(table[:full]) if ref.holder == order.src]
        if not movable:
            order.waited += 1
            if order.waited > MAX_WAIT_STEPS:
                order.error = f"no full rBlock of the sequence on {order.src} after {MAX_WAIT_STEPS} steps"
            return
        for index in movable[: self.blocks_per_step]:
            if order.moved == len(order.reservation_ids):
                return
            self._move_one(order, index, table[index])

    def _move_one(self, order: Order, index: int, ref: BlockRef) -> None:
        src, dst = self._stub(order.src_address), self._stub(order.dst_address)
        request = apb.ExportBlocksRequest(seq_id=order.seq_id, block_ids=[int(ref.block_id)])
        chunks = list(src.ExportBlocks(request, timeout=self.timeout_s))
        chunks[0].header.reservation_id = order.reservation_ids[order.moved]
        reply = dst.ImportBlocks(iter(chunks), timeout=self.timeout_s)
        try:
            src.FreeSequence(
                apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=[index]), timeout=self.timeout_s
            )
        except grpc.RpcError:
            # The source still serves this index: drop the new copy so no step reads it twice.
            dst.FreeSequence(
                apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=[index]), timeout=self.timeout_s
            )
            raise
        learn = getattr(self.dist.placement, "learn_address", None)
        if learn is not None:
            learn(HolderId(order.dst), order.dst_address)
        table = self.dist.block_table(order.seq_id)
        table[index] = BlockRef(HolderId(order.dst), BlockId(int(reply.block_ids[0])))
        self.dist.replace_table(order.seq_id, table)
        order.moved += 1
        order.bytes_moved += sum(len(c.data) for c in chunks[1:])
        order.cached_hashes.extend(reply.cached_hashes)

    def _reattach(self, order: Order) -> None:
        """Flip the order's entries that still read the source to the destination's attached blocks: one
        FreeSequence of those indices on the source, then the table. An entry no longer on the source (it
        moved meanwhile) ends the order there; the manager drops the unused destination references."""
        table = self.dist.block_table(order.seq_id)
        here = 0
        for index in order.block_indices:
            if index >= len(table) or table[index].holder != order.src:
                break
            here += 1
        if here:
            src = self._stub(order.src_address)
            request = apb.FreeSequenceRequest(seq_id=order.seq_id, block_indices=order.block_indices[:here])
            src.FreeSequence(request, timeout=self.timeout_s)  # all or nothing: a failure changes nothing
            learn = getattr(self.dist.placement, "learn_address", None)
            if learn is not None:
                learn(HolderId(order.dst), order.dst_address)
            for index, block_id in zip(order.block_indices[:here], order.dst_block_ids[:here], strict=True):
                table[index] = BlockRef(HolderId(order.dst), BlockId(block_id))
            self.dist.replace_table(order.seq_id, table)
            order.moved = here
        if here < len(order.block_indices):
            order.error = f"rBlock {order.block_indices[here]} of the sequence is no longer on {order.src}"

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
