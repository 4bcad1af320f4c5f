"""The compute instance's engine thread: one ``LLMEngine`` stepped continuously, fed by a command queue.

gRPC handlers run on an asyncio loop; the engine (model + scheduler + remote attention) runs on its own
thread, since a step is seconds of blocking compute and RPCs. Handlers ``submit`` a request with a sink
(called on the engine thread with each ``RequestOutput`` or an exception) and ``abort`` it; the loop applies
commands between steps, so the engine itself stays single-threaded (its contract).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from infinite_llm.core.errors import InfiniteLLMError, Unavailable
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
MAX_RECOVERIES = 5  # consecutive failed steps before the requests fail with UNAVAILABLE
RECOVERY_BACKOFF_S = 0.5  # times the attempt number: lets the dead server's lease lapse (seconds)
Sink = Callable[[RequestOutput | Exception], None]


@dataclass(frozen=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineLoop:
    """Runs ``engine.step()`` on a daemon thread while there is work; thread-safe ``submit``/``abort``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.generated_tokens = 0
        self._failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, sink: Sink) -> None:
        self._commands.put(_Submit(request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    # ---- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            if not self._apply_commands(block):
                return
            if self.engine.has_unfinished():
                self._step()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False when asked to stop."""
        try:
            cmd = self._commands.get(block=block)
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

    def _apply(self, cmd: _Submit | _Abort) -> None:
        if isinstance(cmd, _Submit):
            try:
                self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
            except Exception as e:  # noqa: BLE001 - delivered to the caller, the loop goes on
                cmd.sink(e)
                return
            self._sinks[cmd.request_id] = cmd.sink
            return
        sink = self._sinks.pop(cmd.request_id, None)
        if sink is not None:
            sink(self.engine.abort(cmd.request_id))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Unavailable as e:
            self._recover(e)
            return
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the process
            log.exception("engine step failed; failing %d requests", len(self._sinks))
            self._fail_all(e)
            return
        self._failures = 0
        for out in outputs:
            self.generated_tokens += len(out.new_token_ids)
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

    def _recover(self, error: Unavailable) -> None:
        """An attention server became unreachable mid-step: its KV is gone. Recompute every running sequence
        from its tokens on the servers that remain (greedy output stays identical); give up after
        ``MAX_RECOVERIES`` failed steps in a row."""
        self._failures += 1
        if self._failures > MAX_RECOVERIES:
            log.error("step failed %d times in a row (%s); failing %d requests", self._failures, error,
                      len(self._sinks))
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

    def _fail_all(self, error: Exception) -> None:
        for rid, sink in list(self._sinks.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - freeing may fail for the same reason the step did
                log.warning("could not free request %s after a failure", rid)
            sink(error)
        self._sinks.clear()
