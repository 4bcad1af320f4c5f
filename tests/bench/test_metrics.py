"""The benchmark's pure metrics: percentiles, inter-token latencies, per-request and aggregate numbers.

Expected values are worked out by hand from the definitions in ``infinite_llm.bench.metrics`` (vLLM's);
the percentiles agree with numpy's default ``linear`` method.
"""

from __future__ import annotations

import pytest

from infinite_llm.bench.metrics import (
    Distribution,
    RequestRecord,
    inter_token_latencies,
    percentile,
    summarize,
)


def approx(x: float) -> object:
    return pytest.approx(x, rel=0, abs=1e-9)


# ---- percentile ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "q,expected",
    [(0, 1.0), (25, 1.75), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)],
)
def test_percentile_interpolates_linearly_between_order_statistics(q, expected):
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == approx(expected)


def test_percentile_of_one_value_is_that_value():
    assert [percentile([7.5], q) for q in (0, 50, 99, 100)] == [7.5, 7.5, 7.5, 7.5]


def test_percentile_of_odd_count_median_is_the_middle_value():
    assert percentile([10, 50, 20, 40, 30], 50) == 30
    assert percentile([10, 50, 20, 40, 30], 90) == approx(46.0)


@pytest.mark.parametrize("values,q,message", [([], 50, "empty"), ([1.0], 101, "in [0, 100]"), ([1.0], -1, "[0, 100]")])
def test_percentile_rejects_empty_input_and_out_of_range_q(values, q, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        percentile(values, q)


# ---- inter-token latency ---------------------------------------------------------------------------------
def test_itl_is_the_gap_between_consecutive_one_token_chunks():
    assert inter_token_latencies([1.0, 1.5, 2.25, 2.5], [1, 1, 1, 1]) == [0.5, 0.75, 0.25]


def test_itl_splits_a_multi_token_chunk_gap_evenly_over_its_tokens():
    # the second chunk holds 4 tokens that arrived 2 s after the first: 4 ITLs of 0.5 s
    assert inter_token_latencies([0.0, 2.0, 3.0], [2, 4, 1]) == [0.5, 0.5, 0.5, 0.5, 1.0]


def test_itl_folds_an_empty_chunk_into_the_next_gap():
    assert inter_token_latencies([0.0, 1.0, 3.0], [1, 0, 1]) == [3.0]


def test_itl_of_a_single_chunk_is_empty():
    assert inter_token_latencies([4.0], [8]) == []
    assert inter_token_latencies([], []) == []


def test_itl_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 chunk times but 1 token counts"):
        inter_token_latencies([0.0, 1.0], [1])


# ---- one request -----------------------------------------------------------------------------------------
def test_request_ttft_tpot_and_e2e():
    r = RequestRecord(
        True,
        start=10.0,
        end=14.0,
        input_tokens=32,
        output_tokens=5,
        chunk_times=(11.0, 12.0, 12.5, 13.0, 14.0),
        chunk_tokens=(1, 1, 1, 1, 1),
    )
    assert r.ttft == 1.0
    assert r.e2e == 4.0
    assert r.tpot == 0.75  # (4 - 1) / (5 - 1)


def test_request_with_one_token_has_no_tpot_and_without_chunks_no_ttft():
    assert RequestRecord(True, 0.0, 1.0, output_tokens=1, chunk_times=(0.5,), chunk_tokens=(1,)).tpot is None
    assert RequestRecord.failure(0.0, 1.0, "boom").ttft is None


# ---- the summary -----------------------------------------------------------------------------------------
def _records() -> list[RequestRecord]:
    a = RequestRecord(
        True, 0.0, 0.4, input_tokens=30, output_tokens=3, chunk_times=(0.1, 0.2, 0.4), chunk_tokens=(1, 1, 1)
    )
    b = RequestRecord(True, 0.5, 1.5, input_tokens=34, output_tokens=3, chunk_times=(0.8, 1.5), chunk_tokens=(1, 2))
    bad = RequestRecord.failure(0.2, 0.3, "CapacityExhausted: no room")
    return [a, bad, b, RequestRecord.failure(1.0, 1.0, "CapacityExhausted: no room")]


def test_summary_counts_and_throughputs_come_from_completed_requests_only():
    s = summarize(_records(), duration_s=2.0)
    assert (s.completed, s.failed) == (2, 2)
    assert (s.total_input_tokens, s.total_output_tokens) == (64, 6)
    assert s.request_throughput == 1.0
    assert s.output_throughput == 3.0
    assert s.total_token_throughput == 35.0
    assert s.errors == {"CapacityExhausted: no room": 2}


def test_summary_latencies_in_milliseconds():
    s = summarize(_records(), duration_s=2.0)
    # TTFT: 0.1 s and 0.3 s
    assert s.ttft_ms == Distribution(approx(200.0), approx(200.0), approx(280.0), approx(298.0))
    # E2E: 0.4 s and 1.0 s
    assert s.e2e_latency_ms == Distribution(approx(700.0), approx(700.0), approx(940.0), approx(994.0))
    # TPOT: (0.4 - 0.1) / 2 = 0.15 s and (1.0 - 0.3) / 2 = 0.35 s
    assert s.tpot_ms == Distribution(approx(250.0), approx(250.0), approx(330.0), approx(348.0))
    # ITL: a -> 0.1, 0.2; b -> its 2-token chunk 0.7 s after the first -> 0.35, 0.35
    assert s.itl_ms.mean == approx(250.0)
    assert s.itl_ms.p50 == approx(275.0)
    assert s.itl_ms.p90 == approx(350.0)


def test_summary_of_only_failures_has_no_latencies():
    s = summarize([RequestRecord.failure(0.0, 1.0, "x")], duration_s=1.0)
    assert (s.completed, s.failed, s.request_throughput) == (0, 1, 0.0)
    assert s.ttft_ms == Distribution(None, None, None, None)


def test_summary_rejects_a_non_positive_duration():
    with pytest.raises(ValueError, match="duration must be positive, got 0"):
        summarize([], 0)
