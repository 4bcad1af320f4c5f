"""The compute instance's engine thread: one ``LLMEngine`` stepped continuously, fed by a command queue.

gRPC handlers run on an asyncio loop; the engine (model + scheduler + remote attention) runs on its own
thread, since a step is seconds of blocking compute and RPCs. Handlers ``submit`` a request with a sink
(called on the engine thread with each ``RequestOutput`` or an exception) and ``abort`` it; the loop applies
commands between steps, so the engine itself stays single-threaded (its contract). An abort of a request
the running step serves cuts that step at its next layer (``LLMEngine.step``'s ``interrupt``), so the
request's rBlocks are freed within a layer's time, not a step's; the others run the step again without
it. A request that fails alone (its submit, or its placement in a step: ``RequestOutput.error``) fails its
own sink only; a step that fails as a whole fails every request (after recovery attempts when an attention
server is lost).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from infinite_llm.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InfiniteLLMError,
    NotFound,
    QueueFull,
    Unavailable,
)
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import LLMEngine, RequestOutput
from infinite_llm.observability.metrics import EngineMetrics

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer(__name__)
MAX_RECOVERIES = 5  # consecutive failed steps before the requests fail with UNAVAILABLE
RECOVERY_BACKOFF_S = 0.5  # times the attempt number: lets the dead server's lease lapse (seconds)
Sink = Callable[[RequestOutput | Exception], None]


@dataclass(frozen=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: Sink
    trace_context: otel_context.Context  # the caller's span: engine steps serving it join its trace


_WAKE = object()  # a command that only wakes the engine thread (EngineLoop.wake)


@dataclass(frozen=True)
class _Abort:
    request_id: str


# An abort cuts a running step at most once per this many seconds (EngineLoop.cut_interval_s).
CUT_INTERVAL_S = 2.0
# A step that can run nothing (every sequence waits for rBlocks: the cluster is full, or placement is paused
# while the manager is unreachable) is tried again after a wait that doubles from the first to the second
# figure (seconds), ended early by any new command: not in a loop that spins a core and floods the log.
STALLED_WAIT_S = (0.005, 0.1)


class EngineLoop:
    """Runs ``engine.step()`` on a daemon thread while there is work; thread-safe ``submit``/``abort``."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        max_waiting: int = 1024,
        cut_interval_s: float = CUT_INTERVAL_S,
    ) -> None:
        """``max_waiting``: requests queued behind the running batch before new ones are refused with
        ``QueueFull`` (RESOURCE_EXHAUSTED; HTTP 429 at the gateway): backpressure, not an unbounded
        queue whose latency nobody can see. ``cut_interval_s``: an abort cuts a running step (which the
        other requests then run again) at most once per this many seconds; aborts in between wait for the
        step's end, so a client that aborts request after request cannot keep everyone's steps from
        finishing."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.cut_interval_s = cut_interval_s
        self._last_cut = -float("inf")  # time.monotonic() of the last step cut by an abort
        self.metrics = metrics
        self._contexts: dict[str, otel_context.Context] = {}
        self._last_token_at: dict[str, float] = {}
        self._commands: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._aborting: set[str] = set()  # request ids whose _Abort is queued, not yet applied
        self._aborting_lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.generated_tokens = 0
        self._failures = 0
        self.between_steps: Callable[[], None] | None = None  # e.g. a migration's next rBlocks (engine thread)
        # engine thread, each time before it waits with nothing to run: e.g. migration orders whose sequences
        # ended settle now rather than at the next request's first step (never raises)
        self.when_idle: Callable[[], None] | None = None
        self.steps, self.step_seconds = 0, 0.0  # decode steps run and their wall time (seconds), for heartbeats

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)

    def wake(self) -> None:
        """Let an idle engine thread run ``when_idle`` (thread-safe)."""
        self._commands.put(_WAKE)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, sink: Sink) -> None:
        self._commands.put(_Submit(request_id, prompt, params, sink, otel_context.get_current()))

    def abort(self, request_id: str) -> None:
        """End a request; a step that runs it is cut at its next layer (its rBlocks are freed right after)."""
        with self._aborting_lock:
            self._aborting.add(request_id)
        self._commands.put(_Abort(request_id))

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def num_tokens_held(self) -> int:
        """Tokens whose KV the running sequences hold (on any attention server). Read from other threads:
        it sums over a copy of the running list, so a step in progress may make it one step stale."""
        return sum(seq.num_computed_tokens for seq in self.engine.scheduler.running[:])

    # ---- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        stalled = 0  # consecutive steps that ran nothing while sequences waited
        while True:
            try:
                block = not self.engine.has_unfinished()
                if block and self.when_idle is not None:
                    self.when_idle()
                wait = min(STALLED_WAIT_S[0] * 2 ** min(stalled - 1, 30), STALLED_WAIT_S[1]) if stalled else 0.0
                if not self._apply_commands(block, wait):
                    return
                if self.engine.has_unfinished():
                    self._step()
                    stalled = stalled + 1 if self.stalled else 0
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one failure (e.g. a failed free)
                log.exception("engine loop error; failing %d requests", len(self._sinks))
                self._fail_all(e)

    @property
    def stalled(self) -> bool:
        """Whether the last step ran nothing though sequences wait (engine thread)."""
        return self.engine.has_unfinished() and not self.engine.last_step_scheduled

    def _apply_commands(self, block: bool, wait_s: float = 0.0) -> bool:
        """Apply queued commands (waiting for one when idle, or up to ``wait_s`` seconds for one); False
        when asked to stop."""
        try:
            cmd = self._commands.get(block=block or wait_s > 0, timeout=None if block else wait_s or None)
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                self._fail_all(InfiniteLLMError("compute instance is shutting down"))
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Submit | _Abort | object) -> None:
        if cmd is _WAKE:
            return
        if isinstance(cmd, _Submit) and len(self.engine.scheduler.waiting) >= self.max_waiting:
            cmd.sink(
                QueueFull(
                    f"{len(self.engine.scheduler.waiting)} requests are already waiting for this compute instance "
                    f"(the most it queues is {self.max_waiting}); retry later"
                )
            )
            return
        if isinstance(cmd, _Submit):
            try:
                self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
            except Exception as e:  # noqa: BLE001 - delivered to the caller, the loop goes on
                cmd.sink(e)
                return
            self._sinks[cmd.request_id] = cmd.sink
            self._contexts[cmd.request_id] = cmd.trace_context
            return
        with self._aborting_lock:
            self._aborting.discard(cmd.request_id)
        sink = self._sinks.pop(cmd.request_id, None)
        if sink is not None:
            out = self.engine.abort(cmd.request_id)
            self._observe(out)
            sink(out)

    def _step(self) -> None:
        if self.between_steps is not None:
            self.between_steps()  # never raises: it records its own failures
        try:
            started = time.perf_counter()
            interrupted = self.engine.num_interrupted_steps
            with self._step_span():
                outputs = self.engine.step(self._interrupt)
            if self.engine.num_interrupted_steps == interrupted:  # a cut step (an abort) is no step's pace
                elapsed = time.perf_counter() - started
                self.steps, self.step_seconds = self.steps + 1, self.step_seconds + elapsed
                if self.metrics is not None:
                    self.metrics.step_seconds.observe(elapsed)
        except (Unavailable, DeadlineExceeded, NotFound, FailedPrecondition) as e:  # a server unreachable or
            # frozen (a step's or a placement's deadline), one that lost (fenced) our KV, or one whose rBlocks
            # of a sequence are not what its block table says
            self._recover(e)
            return
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the process
            log.exception("engine step failed; failing %d requests", len(self._sinks))
            self._fail_all(e)
            return
        self._failures = 0
        if self.metrics is not None:
            self.metrics.sync_preemptions()
        for out in outputs:
            if out.error is not None:
                self._fail_one(out.request_id, out.error)
                continue
            self.generated_tokens += len(out.new_token_ids)
            self._observe(out)
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

    def _interrupt(self) -> bool:
        """Engine thread, before each layer of a step: True when a running request was aborted meanwhile,
        so the step is cut and its rBlocks are freed now rather than after the step (seconds on a CPU);
        at most once per ``cut_interval_s`` (the other requests of a cut step run it again)."""
        if not self._aborting:  # the common case, read without the lock
            return False
        if time.monotonic() - self._last_cut < self.cut_interval_s:
            return False
        with self._aborting_lock:
            aborting = set(self._aborting)
        if not any(seq.seq_id in aborting for seq in self.engine.scheduler.running):
            return False
        self._last_cut = time.monotonic()
        return True

    def _step_span(self):  # noqa: ANN202
        """A span for one engine step, child of the oldest live request's trace, linked to the others."""
        contexts = [self._contexts[r] for r in self._sinks if r in self._contexts]
        if not contexts:
            return _TRACER.start_as_current_span("engine.step")
        links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in contexts[1:]]
        return _TRACER.start_as_current_span("engine.step", context=contexts[0], links=links)

    def _observe(self, out: RequestOutput) -> None:
        """Latency and token metrics of one output (vLLM's definitions)."""
        now = time.monotonic()
        last = self._last_token_at.get(out.request_id)
        if out.new_token_ids:
            self._last_token_at[out.request_id] = now
        if out.finished:
            self._last_token_at.pop(out.request_id, None)
            self._contexts.pop(out.request_id, None)
        m = self.metrics
        if m is None:
            return
        m.generation_tokens.inc(len(out.new_token_ids))
        if out.new_token_ids:
            (m.ttft if last is None else m.itl).observe(now - (out.arrival_time if last is None else last))
        if out.finished:
            m.e2e.observe(now - out.arrival_time)
            m.prompt_tokens.inc(out.prompt_tokens)
            m.success.labels(finished_reason=out.finish_reason or "abort").inc()
            if out.first_scheduled_time is not None:
                m.queue.observe(out.first_scheduled_time - out.arrival_time)

    def _recover(self, error: Unavailable | DeadlineExceeded | NotFound | FailedPrecondition) -> None:
        """An attention server became unreachable mid-step, or no longer knows a sequence (it was fenced
        after a pause past its lease and rejoined empty): its KV is gone; or one refused a step because it
        holds other rBlocks of a sequence than the block table puts there (``SeqStep.num_blocks_here``: a
        leftover of an earlier placement), which a release frees with the rest. Recompute every running
        sequence from its tokens on the servers that remain (greedy output stays identical); give up after
        ``MAX_RECOVERIES`` failed steps in a row."""
        self._failures += 1
        if self.metrics is not None:
            self.metrics.step_recoveries.inc()
        if self._failures > MAX_RECOVERIES:
            log.error(
                "step failed %d times in a row (%s); failing %d requests", self._failures, error, len(self._sinks)
            )
            self._fail_all(error)
            return
        try:
            n = self.engine.recompute_all()
        except Exception as e:  # noqa: BLE001 - the manager itself may be unreachable
            log.exception("could not requeue after a lost attention server")
            self._fail_all(e)
            return
        log.warning("attention server lost (%s); recomputing %d sequences (attempt %d)", error, n, self._failures)
        time.sleep(RECOVERY_BACKOFF_S * self._failures)

    def _fail_one(self, request_id: str, error: Exception) -> None:
        """Deliver ``error`` to one request the engine already dropped; the others go on."""
        log.info("request %s failed alone: %s", request_id[:64], error)
        self._contexts.pop(request_id, None)
        self._last_token_at.pop(request_id, None)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(error)

    def _fail_all(self, error: Exception) -> None:
        for rid, sink in list(self._sinks.items()):
            self._contexts.pop(rid, None)
            self._last_token_at.pop(rid, None)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - freeing may fail for the same reason the step did
                log.warning("could not free request %s after a failure", rid)
            sink(error)
        self._sinks.clear()
