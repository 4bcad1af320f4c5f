"""Continuous-batching scheduler: waiting/running queues, chunked prefill under a token budget, preemption.

Each step the scheduler gives every running sequence its next tokens (one for decode, a chunk for a
prefill still in progress), then admits waiting sequences while the per-step token budget, the sequence
cap and free rBlocks allow. When a running sequence needs an rBlock and none is free, the most recently
admitted running sequence is preempted by recompute: its blocks are freed and it goes back to the front
of the waiting queue with its tokens so far, to be prefilled again (vLLM v1's policy). A waiting sequence
is admitted only when the rBlocks of all its tokens not yet computed can be placed at once (vLLM v0's
``can_allocate``), though its prefill still runs in budget-sized chunks: admitted on its first chunk alone,
a prompt longer than the budget could find the rest of its rBlocks taken by the time its next chunk runs
(by another compute instance placing in the same attention servers, or by its own batch's decodes), and
would preempt itself and prefill again from the start, step after step. The scheduler talks
to KV memory only through the small :class:`BlockManager` protocol, so the same code drives local
partitions and remote attention servers. A placement refused for one sequence's own sake (its id, or a
sequence released behind its back: :data:`REQUEST_ERRORS`) fails that sequence alone; the rest of the
step goes on. A placement that is unreachable or late (``Unavailable``: a manager or etcd outage;
``DeadlineExceeded``: a frozen attention server it reserved on) holds back only
the sequences that need new rBlocks; the others keep stepping. Source: vLLM v1 ``Scheduler.schedule``,
nano-vllm ``scheduler.py``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from infinite_llm.core.constraints import TokenConstraint
from infinite_llm.core.errors import (
    DeadlineExceeded,
    InfiniteLLMError,
    InvalidRequest,
    KVCapacityExceeded,
    KVMemoryLost,
    NotFound,
    Unavailable,
)
from infinite_llm.core.logprobs import TokenLogprob
from infinite_llm.core.sampling import SamplingParams

# What ``try_allocate`` raises about one sequence: a bad id, an unknown or released sequence. ``Unavailable``
# (placement unreachable) defers the sequence; anything else propagates out of ``schedule``.
REQUEST_ERRORS = (InvalidRequest, NotFound)
log = logging.getLogger(__name__)
STALL_LOG_INTERVAL_S = 5.0  # a sequence waiting for unreachable placement is logged at most this often (seconds)


class BlockManager(Protocol):
    """Where rBlocks come from. ``try_allocate`` is all-or-nothing: a remote placement may fail even when
    a stale capacity view said it would fit, so the scheduler never relies on a separate check."""

    block_size: int

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Free rBlocks as the block manager sees them (maybe stale: only a hint)."""

    def try_allocate(self, seq_id: str, n: int) -> bool: ...

    def free(self, seq_id: str) -> int: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request's token state. ``num_computed_tokens`` tokens have KV; ``num_blocks`` rBlocks are held."""

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: InfiniteLLMError | None = None  # why it finished with reason "error"
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, monotonic clock
    outgrown_since: float | None = None  # monotonic time since its tokens need more rBlocks than all KV memory
    first_scheduled_time: float | None = None
    # log-probabilities asked for by ``params``: of prompt tokens 1.. (a recomputed prefill adds none twice),
    # and of each output token (parallel to ``output_token_ids``)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # token ids that end it (EOS unless ignore_eos, stop_token_ids)
    constraint: TokenConstraint | None = None  # structured output: the tokens it may sample next

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_new`` tokens of ``seq`` run this step, from position ``num_computed_tokens`` (the tokens that
    already have KV); ``samples`` when the step ends the sequence's known tokens."""

    seq: Sequence
    num_computed_tokens: int
    num_new: int

    @property
    def samples(self) -> bool:
        return self.num_computed_tokens + self.num_new == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """``failed``: sequences finished with reason "error" this step (``seq.error`` says why)."""

    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_batched_tokens``: per-step token budget (chunked prefill); ``max_num_seqs``: batch cap.

    ``placement_lookahead_blocks``: when a running sequence needs rBlocks, ask for up to this many more in
    the same placement (never past what its prompt + ``max_tokens`` can fill), so that a decode crosses
    ``lookahead + 1`` block boundaries per placement instead of one. Worth it where a placement is a round
    trip (a compute instance's ``Place`` to the global manager, an etcd transaction); 0 (exact) for
    in-process rManagers. The extra rBlocks are asked for only while no sequence waits and the block
    manager reports room for them; if they do not fit, the exact need is placed.

    ``capacity_wait_s``: a waiting sequence whose tokens so far need more rBlocks than the KV memory now
    holds in all (attention servers left the cluster after it was admitted) waits this long (seconds) for
    the memory to come back (a restarting server), then fails with ``KVMemoryLost`` (RESOURCE_EXHAUSTED / HTTP
    503: the request may succeed later) instead of waiting for its deadline.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    placement_lookahead_blocks: int = 0
    capacity_wait_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"scheduler limits must be >= 1, got {self}")
        if self.placement_lookahead_blocks < 0:
            raise ValueError(f"placement_lookahead_blocks must be >= 0, got {self.placement_lookahead_blocks}")
        if self.capacity_wait_s < 0:
            raise ValueError(f"capacity_wait_s must be >= 0, got {self.capacity_wait_s}")


class Scheduler:
    """Owns the waiting and running queues; allocates rBlocks through ``blocks``."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._stall_logged = (-float("inf"), 0)  # (monotonic time of the last stall warning, stalls since)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises ``KVCapacityExceeded`` if it could never fit in all of KV memory, and
        ``Unavailable`` (retry) while there is no KV memory at all (no attention server registered: a
        cluster starting, or a global manager that took the lead and waits for its members to register)."""
        if not seq.prompt_token_ids:
            raise InvalidRequest("prompt is empty")
        prompt, bs, total = len(seq.prompt_token_ids), self.blocks.block_size, self.blocks.num_total_blocks
        if total == 0:
            raise Unavailable("no attention server is registered (yet): no KV memory to place the request in")
        need = -(-(prompt + seq.params.max_tokens) // bs)
        fits = total * bs - prompt
        if need > total and seq.params.max_tokens_defaulted and fits >= max(seq.params.min_tokens, 1):
            # A default the caller never set must not fail a request that fits: it ends at KV memory's end
            # (finish_reason "length"), as a vLLM default ends at the context's end.
            seq.params = replace(seq.params, max_tokens=fits)
        elif need > total:
            # Name max_tokens and what would fit (the prompt when it alone cannot).
            raise KVCapacityExceeded(
                f"request needs {need} rBlocks of {bs} tokens ({prompt} prompt + {seq.params.max_tokens} max_tokens), "
                f"the KV memory holds {total} in all: it can never fit"
                + (f"; max_tokens <= {fits} would fit" if fits > 0 else ""),
                param="max_tokens" if fits > 0 else "prompt",
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        failed: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, f"running sequence {seq.seq_id} has nothing to compute"
            try:
                while not self._try_grow(seq, num_new, lookahead=not self.waiting):
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
            except REQUEST_ERRORS as e:
                failed.append(self._fail(seq, e))
                continue  # it left the running list: the next sequence is at i now
            except (Unavailable, DeadlineExceeded) as e:  # placement unreachable (a manager or etcd outage) or
                # not answering in time (a frozen server it reserved on): it waits, the rest step
                self._warn_stalled(seq, e)
                i += 1
                continue
            if seq.status is not SequenceStatus.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            try:
                short_s = self._short_of_memory_s(seq)
                if short_s is not None and short_s >= self.config.capacity_wait_s:
                    failed.append(self._fail(seq, self._outgrown_error(seq)))
                    continue  # it left the waiting queue
                if short_s is not None:  # it cannot be admitted until memory comes back (first come, first served)
                    break
                if not self.blocks.num_free_blocks:  # admitting needs a new rBlock: match no prefix in vain
                    break
                self._match_prefix(seq)
                remaining = seq.num_tokens - seq.num_computed_tokens
                num_new = min(remaining, budget)
                if not self._try_grow(seq, remaining):  # every chunk's rBlocks, not only this step's
                    self._unmatch(seq)
                    break
            except REQUEST_ERRORS as e:
                failed.append(self._fail(seq, e))
                continue  # it left the waiting queue
            except (Unavailable, DeadlineExceeded):  # placement unreachable or late: admit nobody this step
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted, failed)

    def _warn_stalled(self, seq: Sequence, error: Unavailable | DeadlineExceeded) -> None:
        """Log a running sequence that gets no rBlocks this step, at most once per ``STALL_LOG_INTERVAL_S``
        (an outage stalls it step after step), with how many such stalls went unlogged since."""
        now = time.monotonic()
        last, since = self._stall_logged
        if now - last < STALL_LOG_INTERVAL_S:
            self._stall_logged = (last, since + 1)
            return
        more = f" ({since} more stalls since the last warning, {now - last:.0f} s ago)" if since else ""
        log.warning("no rBlocks for %r this step: %s%s", seq.seq_id[:64], error, more)
        self._stall_logged = (now, 0)

    def _short_of_memory_s(self, seq: Sequence) -> float | None:
        """Seconds since ``seq``'s tokens first needed more rBlocks than the whole KV memory holds (attention
        servers left after it was admitted); None while they fit (memory that comes back stops the clock)."""
        if -(-seq.num_tokens // self.blocks.block_size) <= self.blocks.num_total_blocks:
            seq.outgrown_since = None
            return None
        now = time.monotonic()
        if seq.outgrown_since is None:
            seq.outgrown_since = now
            log.warning(
                "sequence %s needs more rBlocks than the KV memory now holds in all; waiting up to %g s for it "
                "to come back",
                seq.seq_id[:64],
                self.config.capacity_wait_s,
            )
        return now - seq.outgrown_since

    def _outgrown_error(self, seq: Sequence) -> KVMemoryLost:
        bs, total = self.blocks.block_size, self.blocks.num_total_blocks
        return KVMemoryLost(
            f"the KV memory shrank to {total} rBlocks of {bs} tokens in all (attention servers left) and this "
            f"request's {seq.num_tokens} tokens need {-(-seq.num_tokens // bs)}; it waited "
            f"{self.config.capacity_wait_s:.0f} s for memory to come back: retry once the cluster has its "
            "attention servers again"
        )  # no param: the cluster changed, not the request

    def _fail(self, seq: Sequence, error: InfiniteLLMError) -> Sequence:
        """Finish ``seq`` with reason "error" because of ``error``; its rBlocks are freed where possible."""
        seq.error = error
        try:
            self.finish(seq, "error")
        except REQUEST_ERRORS:  # the free failed for the same reason (e.g. its id): nothing was placed
            log.warning("could not free the rBlocks of failed sequence %r", seq.seq_id[:64])
        return seq

    def _match_prefix(self, seq: Sequence) -> None:
        """A sequence with no KV yet starts from the longest cached prefix of its tokens (shared rBlocks,
        whole blocks, never its last token), when the block manager caches prefixes. A request asking for
        its prompt's log-probabilities computes every prompt token (vLLM does the same)."""
        match = getattr(self.blocks, "match_prefix", None)
        if match is None or seq.num_blocks or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return
        cached = match(seq.seq_id, seq.all_token_ids)
        seq.num_computed_tokens = cached
        seq.num_blocks = cached // self.blocks.block_size

    def _unmatch(self, seq: Sequence) -> None:
        """A waiting sequence that could not be admitted gives back the cached prefix it matched, as vLLM's
        all-or-nothing ``allocate_slots`` does: held while waiting, two readers of one prefix (each preempted
        in turn) could each hold what the other needs to grow, and neither would be admitted again. The
        sequence forgets them before the release (which rides out a manager outage itself), so a release
        error, which fails the request, leaves no stale count behind."""
        if seq.num_blocks:
            seq.num_blocks = 0
            seq.num_computed_tokens = 0
            self.blocks.free(seq.seq_id)

    def _try_grow(self, seq: Sequence, num_new: int, lookahead: bool = False) -> bool:
        """Give ``seq`` the rBlocks its next ``num_new`` tokens need; False (nothing changed) if none. With
        ``lookahead``, first try up to ``placement_lookahead_blocks`` more (see :class:`SchedulerConfig`)."""
        bs = self.blocks.block_size
        need = max(0, -(-(seq.num_computed_tokens + num_new) // bs) - seq.num_blocks)
        if not need:
            return True
        extra = 0
        if lookahead and self.config.placement_lookahead_blocks:
            # All it can ever fill: the prompt and every output token but the last (sampled, never attended)
            most = -(-(len(seq.prompt_token_ids) + seq.params.max_tokens - 1) // bs)
            extra = min(self.config.placement_lookahead_blocks, max(0, most - seq.num_blocks - need))
            try:
                if extra and self.blocks.num_free_blocks < need + extra:
                    extra = 0
            except Unavailable:  # no capacity view now: place the exact need (which may fail the same way)
                extra = 0
        if extra and self.blocks.try_allocate(seq.seq_id, need + extra):
            seq.num_blocks += need + extra
            return True
        if not self.blocks.try_allocate(seq.seq_id, need):
            return False
        seq.num_blocks += need
        return True

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence now (recompute later); used when its KV was lost."""
        self.running.remove(seq)
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV and requeue it first in line, to be recomputed from its tokens."""
        self.blocks.free(seq.seq_id)
        seq.num_blocks = 0
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def mark_computed(self, out: SchedulerOutput) -> None:
        """Record that the step ran: every scheduled sequence now has KV for its new tokens."""
        publish = getattr(self.blocks, "cache_computed", None)
        bs = self.blocks.block_size
        for s in out.scheduled:
            assert s.seq.num_computed_tokens == s.num_computed_tokens, "step results applied twice"
            s.seq.num_computed_tokens += s.num_new
            if publish is not None and s.seq.num_computed_tokens // bs > s.num_computed_tokens // bs:
                publish(s.seq.seq_id, s.seq.all_token_ids, s.seq.num_computed_tokens)  # the full rBlocks it completed
        flush = getattr(self.blocks, "flush_published", None)
        if flush is not None:
            flush()  # a placement that batches publishing sends the step's full rBlocks now, before any free

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length, abort): free its rBlocks and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            raise NotFound(f"sequence {seq.seq_id!r} already finished")
        seq.status = SequenceStatus.FINISHED  # finished even if freeing raises
        seq.finish_reason = reason
        seq.num_blocks = 0
        self.blocks.free(seq.seq_id)
