"""The load generator against a fake target: arrivals, the concurrency limit, the deadline, failures."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from infinite_llm.bench.datasets import BenchRequest
from infinite_llm.bench.metrics import RequestRecord
from infinite_llm.bench.runner import LoadConfig, arrival_offsets, run_load
from infinite_llm.bench.targets import RequestFailed, gateway_base_url, sse_data


class FakeTarget:
    """Answers each request after ``delay_s``; prompts equal to "fail" fail; tracks requests in flight."""

    name, address = "fake", "nowhere"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.in_flight = self.most_in_flight = 0
        self.sampling: list[dict] = []

    async def send(self, request: BenchRequest, sampling: dict, timeout_s: float) -> RequestRecord:
        self.sampling.append(sampling)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        start = time.perf_counter()
        try:
            await asyncio.sleep(self.delay_s)
            if request.prompt == "fail":
                raise RequestFailed("HTTP 400: bad prompt")
            now = time.perf_counter()
            return RequestRecord(True, start, now, 3, request.max_tokens, (now,), (request.max_tokens,))
        finally:
            self.in_flight -= 1


def run(target: FakeTarget, prompts: list[str], load: LoadConfig) -> tuple[list[RequestRecord], float]:
    requests = [BenchRequest(p, 2) for p in prompts]
    return asyncio.run(run_load(target, requests, lambda i: {"index": i}, load))


def test_all_at_once_arrivals_are_zero_and_poisson_ones_reproducible():
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    times = arrival_offsets(2000, 50.0, seed=7)
    assert times == arrival_offsets(2000, 50.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)  # mean gap 1 / rate


def test_concurrency_caps_requests_in_flight():
    target = FakeTarget(delay_s=0.05)
    records, duration = run(target, ["p"] * 6, LoadConfig(concurrency=2))
    assert target.most_in_flight == 2
    assert [r.ok for r in records] == [True] * 6
    assert duration >= 0.15  # three waves of two
    assert sorted(s["index"] for s in target.sampling) == list(range(6))


def test_no_limit_sends_everything_at_once():
    target = FakeTarget(delay_s=0.05)
    run(target, ["p"] * 5, LoadConfig())
    assert target.most_in_flight == 5


def test_a_failed_request_is_recorded_and_the_run_goes_on():
    records, _ = run(FakeTarget(delay_s=0.0), ["p", "fail", "p"], LoadConfig(concurrency=1))
    assert [(r.ok, r.error) for r in records] == [(True, None), (False, "HTTP 400: bad prompt"), (True, None)]


def test_the_deadline_cancels_running_requests_and_skips_unsent_ones():
    target = FakeTarget(delay_s=5.0)
    records, duration = run(target, ["p"] * 3, LoadConfig(concurrency=1, timeout_s=0.2))
    assert duration < 2.0
    assert [r.error for r in records] == ["cancelled: the benchmark's --timeout was reached"] + [
        "not sent: the benchmark's --timeout was reached"
    ] * 2
    assert target.in_flight == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"concurrency": 0}, "concurrency must be a positive integer, got 0"),
        ({"request_rate": 0.0}, "request rate must be positive"),
        ({"timeout_s": -1.0}, "timeout must be positive, got -1.0"),
    ],
)
def test_load_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadConfig(**kwargs)


@pytest.mark.parametrize(
    "target,url",
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
        ("http://host:8000/", "http://host:8000/v1"),
        ("https://api.example/v1", "https://api.example/v1"),
    ],
)
def test_gateway_target_becomes_the_v1_base_url(target, url):
    assert gateway_base_url(target) == url


def test_sse_data_lines_yield_their_payload_only():
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data("data: [DONE]") == "[DONE]"
    assert [sse_data(x) for x in ("", ": keep-alive", "event: x")] == [None, None, None]
