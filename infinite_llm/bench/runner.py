"""The load generator: requests arrive on a Poisson schedule (or all at once), at most ``concurrency`` in
flight, and the whole run is bounded by a timeout.

As in vLLM's ``vllm bench serve``, the gap between arrivals is exponential with mean ``1 / request_rate``
(a Poisson process), the concurrency limit applies after arrival, and a request's latencies are measured
from when it is actually sent. A request still running at the deadline is cancelled (the router frees its
rBlocks; the gateway sees the disconnect) and one not yet sent is not sent; both count as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infinite_llm.bench.datasets import BenchRequest
from infinite_llm.bench.metrics import RequestRecord
from infinite_llm.bench.targets import Target, describe_error


@dataclass(frozen=True)
class LoadConfig:
    """``concurrency``: most requests in flight (None: no limit); ``request_rate``: arrivals per second
    (``inf``: all at once); ``timeout_s``: seconds the whole run may take."""

    concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive (or inf), got {self.request_rate}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives: 0 for the first, then exponential gaps
    of mean ``1 / request_rate`` (all 0 for ``inf``)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(request_rate)
        out.append(t)
    return out


async def run_load(
    target: Target,
    requests: Sequence[BenchRequest],
    sampling: Callable[[int], dict],
    load: LoadConfig,
    on_done: Callable[[RequestRecord], None] = lambda _: None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` (request ``i`` with ``sampling(i)``) to an open ``target``.

    Returns one record per request, in order, and the run's duration (s). ``on_done`` sees each record as
    its request ends (the progress display).
    """
    start = time.perf_counter()
    deadline = start + load.timeout_s
    limit = asyncio.Semaphore(load.concurrency) if load.concurrency else contextlib.nullcontext()

    async def one(i: int, arrival: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, min(start + arrival, deadline) - time.perf_counter()))
        async with limit:
            record = await _send(target, requests[i], sampling(i), deadline)
        on_done(record)
        return record

    offsets = arrival_offsets(len(requests), load.request_rate, load.seed)
    records = await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets)))
    return list(records), time.perf_counter() - start


async def _send(target: Target, request: BenchRequest, sampling: dict, deadline: float) -> RequestRecord:
    """One request bounded by ``deadline``; any failure becomes a failed record (the run goes on)."""
    sent = time.perf_counter()
    left = deadline - sent
    if left <= 0:
        return RequestRecord.failure(sent, sent, "not sent: the benchmark's --timeout was reached")
    try:
        return await asyncio.wait_for(target.send(request, sampling, left), left)
    except TimeoutError:
        return RequestRecord.failure(sent, time.perf_counter(), "cancelled: the benchmark's --timeout was reached")
    except Exception as e:  # noqa: BLE001 - a benchmark records every kind of failure and goes on
        return RequestRecord.failure(sent, time.perf_counter(), describe_error(e))
