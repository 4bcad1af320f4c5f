"""What the engine hands back per request and step, and the text side of stop conditions.

``RequestOutput`` carries both the delta of this step (for streaming) and the totals so far (for unary
calls). ``TextStopper`` applies stop strings to the detokenized stream, holding back just enough text that
a stop string split across tokens is never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinite_llm.core.logprobs import TokenLogprob


@dataclass
class RequestOutput:
    """State of one request after a step. ``finish_reason`` is ``stop``, ``length`` or ``abort`` when done, or
    ``error`` when this request alone failed (``error`` says why; the other requests go on)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = 0.0  # monotonic seconds; the request's queue time is first_scheduled - arrival
    first_scheduled_time: float | None = None
    error: Exception | None = None
    # log-probabilities, when the request's params ask: of ``new_token_ids`` and of ``token_ids`` (parallel to
    # them), and of the prompt's tokens (the first output only; entry 0 is None: nothing precedes token 0)
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class TextStopper:
    """Accumulates generated text; finds stop strings; decides what text is safe to emit.

    ``push(piece) -> (emit, stopped)``: ``emit`` is new text certain to be part of the output; when a stop
    string appears the text is cut before it and ``stopped`` is True. Text that could still be the start of
    a stop string is held back until it cannot (or until :meth:`flush` at the end).
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.text = ""
        self._emitted = 0
        self._checked_from = 0  # stop strings are searched from here on (text pushed unchecked is skipped)
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def push(self, piece: str, check: bool = True) -> tuple[str, bool]:
        """``check=False``: no stop string may end the text here (before ``min_tokens``); later checks
        look only at text from this point on, as vLLM's do."""
        search_from = max(self._checked_from, len(self.text) - self._holdback)
        self.text += piece
        cut = -1
        if check:
            cut = min((i for s in self.stop if (i := self.text.find(s, search_from)) >= 0), default=-1)
        else:
            self._checked_from = len(self.text)
        if cut >= 0:
            self.text = self.text[:cut]
            return self.flush(), True
        safe = len(self.text) - self._holdback
        if safe <= self._emitted:
            return "", False
        emit, self._emitted = self.text[self._emitted : safe], safe
        return emit, False

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def flush(self) -> str:
        emit, self._emitted = self.text[self._emitted :], len(self.text)
        return emit
