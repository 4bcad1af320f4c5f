"""Sampling parameters: greedy, temperature, top-k, top-p, a seed, penalties, stops, log-probabilities.

No torch here: the router, the gateway and the SDK validate and encode requests with these types alone. The
sampler that applies them is :mod:`infinite_llm.core.sampler`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.logprobs import MAX_LOGPROBS

# Every decode step searches each sequence's new text for each of its stop strings, and holds back as many
# characters as the longest is long, on the engine thread that serves every request: both are bounded, more
# loosely than OpenAI's 4 strings (and TGI's default ``--max-stop-sequences 4``).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy.

    Raises:
        InvalidRequest: on construction, for any out-of-range value (message names the parameter).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # 0..MAX_LOGPROBS: report each sampled token's logprob and this many top ones
    prompt_logprobs: int | None = None  # 0..MAX_LOGPROBS: the same for every prompt token after the first
    # Logits processors (core/logits_processors.py), OpenAI's and vLLM's meanings: penalties of tokens
    # already generated (presence: once, frequency: per occurrence; in [-2, 2]); repetition (> 0, 1 = off)
    # of tokens in the prompt or the output; a bias per token id in [-100, 100]; no EOS / stop token id
    # before min_tokens output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # Structured output: the text must match this JSON schema (JSON text; '{"type": "object"}' for any
    # object). The engine compiles it to a token constraint (core/constraints.py) when the request arrives.
    json_schema: str | None = None
    # ``max_tokens`` is a default, not the caller's (a chat request without max_tokens): the scheduler lowers
    # it to what all of KV memory can hold beside the prompt rather than refuse the request as never fitting.
    max_tokens_defaulted: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        # Once each: every step asks whether the sampled token is one (the engine bounds them by the vocabulary).
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # the caller's dict may change later
        if not isinstance(self.max_tokens, int) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InvalidRequest(
                f"max_tokens must be a positive integer (0 only to score a prompt with prompt_logprobs), "
                f"got {self.max_tokens!r}",
                param="max_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (isinstance(n, int) and 0 <= n <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {n!r}", param=name)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN; inf makes masked logits NaN
            raise InvalidRequest(f"temperature must be >= 0 and finite, got {self.temperature!r}", param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequest(f"top_k must be >= 1 or unset, got {self.top_k!r}", param="top_k")
        self._check_processors()
        self._check_stops()
        if self.seed is None:
            object.__setattr__(self, "seed", random.getrandbits(63))

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", param="stop")
        for s in self.stop:
            if not isinstance(s, str):
                raise InvalidRequest(f"stop strings must be strings, got {type(s).__name__}", param="stop")
            if not 0 < len(s) <= MAX_STOP_CHARS:
                raise InvalidRequest(
                    f"a stop string must have 1 to {MAX_STOP_CHARS} characters, got one of {len(s)}", param="stop"
                )

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", param=name)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequest(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}", param="repetition_penalty"
            )
        bad = [(t, b) for t, b in self.logit_bias.items() if not (isinstance(t, int) and t >= 0 and -100 <= b <= 100)]
        if bad:
            raise InvalidRequest(
                f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {bad[0][0]!r}: {bad[0][1]!r}",
                param="logit_bias",
            )
        bad_stop = [t for t in self.stop_token_ids if not (isinstance(t, int) and t >= 0)]
        if bad_stop:  # a negative id would index the logits from the end (min_tokens masks them)
            raise InvalidRequest(f"stop_token_ids must be token ids >= 0, got {bad_stop[0]!r}", param="stop_token_ids")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= max(self.max_tokens, 0)):
            raise InvalidRequest(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}", param="min_tokens"
            )

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor changes this request's logits (else they are sampled as they are)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
