"""A benchmark's result for people (two tables: totals and throughputs, latency percentiles) and for machines
(one JSON object: the run's settings, then every field of ``BenchSummary``; latencies in ms)."""

from __future__ import annotations

import math
from dataclasses import asdict, fields

from rich import box
from rich.console import Console
from rich.table import Table

from infinite_llm.bench.metrics import PERCENTILES, BenchSummary, Distribution

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_latency_ms"))


def _json_safe(value: object) -> object:
    """``inf`` as the string ``"inf"`` (as vLLM writes it): JSON has no infinity."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def to_json(summary: BenchSummary, settings: dict) -> dict:
    """``settings`` (backend, target, dataset, load...) followed by the summary's fields."""
    return {**{k: _json_safe(v) for k, v in settings.items()}, **asdict(summary)}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def totals_table(summary: BenchSummary, settings: dict) -> Table:
    table = Table(title="Benchmark result", box=box.SIMPLE, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("Backend", f"{settings['backend']} {settings['target']}")
    table.add_row("Dataset", str(settings["dataset"]))
    load = f"concurrency {settings['concurrency'] or 'unlimited'}, rate {_json_safe(settings['request_rate'])} req/s"
    table.add_row("Load", load, end_section=True)
    table.add_row("Requests completed", str(summary.completed))
    table.add_row("Requests failed", str(summary.failed))
    table.add_row("Duration (s)", _fmt(summary.duration_s))
    table.add_row("Input tokens", str(summary.total_input_tokens))
    table.add_row("Output tokens", str(summary.total_output_tokens), end_section=True)
    table.add_row("Request throughput (req/s)", _fmt(summary.request_throughput, 3))
    table.add_row("Output token throughput (tok/s)", _fmt(summary.output_throughput))
    table.add_row("Total token throughput (tok/s)", _fmt(summary.total_token_throughput))
    return table


def latency_table(summary: BenchSummary) -> Table:
    table = Table(title="Latency (ms)", box=box.SIMPLE, title_justify="left")
    table.add_column("metric")
    for name in [f.name for f in fields(Distribution)]:
        table.add_column(name, justify="right")
    for label, attr in LATENCIES:
        dist: Distribution = getattr(summary, attr)
        table.add_row(label, _fmt(dist.mean), *(_fmt(getattr(dist, f"p{q}")) for q in PERCENTILES))
    return table


def print_summary(summary: BenchSummary, settings: dict, console: Console) -> None:
    console.print(totals_table(summary, settings))
    console.print(latency_table(summary))
    if summary.errors:
        console.print("Errors:", style="bold red")
        for message, count in summary.errors.items():
            console.print(f"  {count} x {message}", markup=False, highlight=False, soft_wrap=True)
