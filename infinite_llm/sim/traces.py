"""Seeded request-length traces for the simulator: a short-context mix and a long-context mix.

The paper's traces (ShareGPT4, L-Eval, an online service's length distribution; PAPER.md "Evaluation") are
not public as length lists, so these are parametric stand-ins (assumptions, documented in the README):

- conversation requests (ShareGPT-like): prompt ~ lognormal(median 600, sigma 1.0) clipped to [16, 16K]
  tokens, output ~ lognormal(median 200, sigma 0.8) clipped to [8, 2K];
- document requests (L-Eval / long-context-like): prompt log-uniform in ``[long_min, long_max]``, output
  ~ lognormal(median 256, sigma 0.5) clipped to [16, 1K].

A trace is ``n`` requests, each a document with probability ``long_fraction``; the same seed gives the same
trace. Lengths are in tokens. Requests arrive together at time 0 (a closed, saturated run) unless
:func:`with_arrivals` gives them Poisson arrival times (an open-loop run at a request rate).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Request:
    """One request: ``prompt_tokens`` to prefill, then ``output_tokens`` to decode (no early stop), arriving
    at ``arrival_s`` seconds of simulated time."""

    req_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class TraceSpec:
    """A length mix: ``n`` requests, a fraction ``long_fraction`` of them documents of ``long_min`` to
    ``long_max`` prompt tokens (log-uniform)."""

    name: str
    n: int
    long_fraction: float
    long_min: int
    long_max: int

    def __post_init__(self) -> None:
        if self.n < 1 or not 0.0 <= self.long_fraction <= 1.0 or not 1 <= self.long_min <= self.long_max:
            raise ValueError(f"bad trace spec {self}")


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), lo), hi))


def generate(spec: TraceSpec, seed: int) -> list[Request]:
    """The ``spec.n`` requests of the trace, ids ``<name>-<i>``; deterministic in ``seed``."""
    rng = random.Random(f"{spec.name}:{seed}")
    out = []
    for i in range(spec.n):
        if rng.random() < spec.long_fraction:
            prompt = int(math.exp(rng.uniform(math.log(spec.long_min), math.log(spec.long_max))))
            output = _lognormal(rng, 256, 0.5, 16, 1024)
        else:
            prompt = _lognormal(rng, 600, 1.0, 16, 16_384)
            output = _lognormal(rng, 200, 0.8, 8, 2048)
        out.append(Request(f"{spec.name}-{i}", prompt, output))
    return out


def with_arrivals(requests: list[Request], rate: float, seed: int) -> list[Request]:
    """``requests`` in order, arriving as a Poisson process of ``rate`` requests per second (exponential
    gaps, the first after one gap); deterministic in ``seed``. Raises ``ValueError`` for a rate <= 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate}")
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for req in requests:
        t += rng.expovariate(rate)
        out.append(replace(req, arrival_s=t))
    return out
