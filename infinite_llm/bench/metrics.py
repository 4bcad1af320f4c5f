"""The metrics of a serving benchmark, computed from per-request timestamps: pure functions, no I/O.

Definitions follow vLLM's ``vllm bench serve`` (``vllm/benchmarks/serve.py``, ``calculate_metrics``):

- **TTFT**: from sending a request to the first chunk that carries output.
- **TPOT**: ``(e2e - ttft) / (output_tokens - 1)``, for requests with more than one output token.
- **ITL** (inter-token latency): the gaps between consecutive output chunks after the first. A chunk carrying
  ``k`` tokens contributes its gap ``k`` times as ``gap / k``; vLLM records one gap per chunk, which is the
  same when every chunk carries one token (the router streams one token per step; the gateway's SSE chunks
  do not say how many tokens they hold and count as one each).
- **E2E latency**: from sending a request to its last chunk.
- Throughputs divide the completed requests' counts by the benchmark's duration (first arrival to last end).

Percentiles interpolate linearly between order statistics (numpy's default ``linear`` method, what vLLM
reports). Times are seconds on one monotonic clock in records; summaries report milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. ``chunk_times[i]`` (s) is when output chunk ``i`` arrived, holding
    ``chunk_tokens[i]`` tokens; token counts are the server's usage when it reports one."""

    ok: bool
    start: float
    end: float
    input_tokens: int = 0
    output_tokens: int = 0
    chunk_times: tuple[float, ...] = ()
    chunk_tokens: tuple[int, ...] = ()
    error: str | None = None

    def __post_init__(self) -> None:
        assert len(self.chunk_times) == len(self.chunk_tokens), (len(self.chunk_times), len(self.chunk_tokens))

    @classmethod
    def failure(cls, start: float, end: float, error: str) -> RequestRecord:
        return cls(ok=False, start=start, end=end, error=error)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``, linear between order statistics.

    Raises ``ValueError`` for an empty sequence or ``q`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """ITLs (s) of one request: chunk ``i > 0`` contributes ``chunk_tokens[i]`` copies of its gap / its tokens.

    The first chunk's tokens have no predecessor (their latency is the TTFT). A chunk with 0 tokens is
    skipped and its gap folds into the next chunk's.
    """
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError(f"{len(chunk_times)} chunk times but {len(chunk_tokens)} token counts")
    itls: list[float] = []
    prev = None
    for t, k in zip(chunk_times, chunk_tokens, strict=True):
        if k <= 0:
            continue
        if prev is not None:
            itls.extend([(t - prev) / k] * k)
        prev = t
    return itls


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds; all None when nothing was measured."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls()
        ms = [v * 1000.0 for v in values]
        return cls(sum(ms) / len(ms), *(percentile(ms, q) for q in PERCENTILES))


@dataclass(frozen=True)
class BenchSummary:
    """The benchmark's result; throughputs count completed requests only (req/s, tokens/s)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_latency_ms: Distribution
    errors: dict[str, int]


def summarize(records: Sequence[RequestRecord], duration_s: float) -> BenchSummary:
    """Aggregate ``records`` over a run of ``duration_s`` seconds (> 0)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in inter_token_latencies(r.chunk_times, r.chunk_tokens)]
    return BenchSummary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Distribution.of_seconds([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=Distribution.of_seconds(itls),
        e2e_latency_ms=Distribution.of_seconds([r.e2e for r in ok]),
        errors=dict(Counter(r.error or "unknown error" for r in records if not r.ok).most_common()),
    )
