"""``infinite-llm bench``: the flags, then prepare (build the requests), run (with a progress display on
stderr) and report (a table, or JSON, on stdout; ``--output-json`` writes the JSON to a file too).

Exit status: 0 when every request completed, 1 when some failed or the target could not be prepared
(the summary is still printed), 2 for bad flags.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from infinite_llm.cli_tls import Insecure, TlsDir, load_cli_tls

if TYPE_CHECKING:  # the command module loads with every `infinite-llm` call: gRPC and httpx only when it runs
    from collections.abc import Callable

    from infinite_llm.bench.datasets import BenchRequest
    from infinite_llm.bench.metrics import RequestRecord
    from infinite_llm.bench.runner import LoadConfig
    from infinite_llm.bench.targets import Target
    from infinite_llm.rpc.tls import TlsConfig

err = Console(stderr=True)

DEFAULT_TARGETS = {"router": "127.0.0.1:50051", "gateway": "http://127.0.0.1:8000"}
DEFAULT_INPUT_LEN = {"synthetic": 1024, "long-doc": 4096}
DEFAULT_QUESTION = "What is the main point of the passage above? Answer briefly."


class Backend(StrEnum):
    router = "router"
    gateway = "gateway"


class DatasetKind(StrEnum):
    synthetic = "synthetic"
    jsonl = "jsonl"
    long_doc = "long-doc"


WORKLOAD = "Workload"
LOAD = "Load"


def bench(
    backend: Annotated[
        Backend,
        typer.Option(
            help="router: the gRPC Router API (SDK); gateway: the OpenAI REST gateway (POST /v1/completions, SSE).",
        ),
    ] = Backend.router,
    target: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT or URL of the router or gateway (default: 127.0.0.1:50051 for the router, "
            "http://127.0.0.1:8000 for the gateway). Requests go to this target only."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model name to ask for (default: the one the mesh serves).")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="INFINITE_LLM_API_KEY", help="Gateway API key, sent as 'Authorization: Bearer <key>'."),
    ] = None,
    dataset: Annotated[
        DatasetKind,
        typer.Option(
            help='synthetic: random common words of drawn lengths; jsonl: one {"prompt", "max_tokens"?} object '
            "per line; long-doc: windows of a long document + a question.",
            rich_help_panel=WORKLOAD,
        ),
    ] = DatasetKind.synthetic,
    dataset_path: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="The JSONL file or the document (jsonl, long-doc).",
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    input_len: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Prompt tokens per request (default: 1024 synthetic, 4096 long-doc; exact on the router, "
            "approximate on the gateway; not used by jsonl).",
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    output_len: Annotated[
        int,
        typer.Option(
            min=1,
            help="Completion tokens per request (jsonl: when a line has no max_tokens).",
            rich_help_panel=WORKLOAD,
        ),
    ] = 128,
    range_ratio: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.999,
            help="Lengths are drawn uniformly between len * (1 - r) and len * (1 + r) (0: fixed).",
            rich_help_panel=WORKLOAD,
        ),
    ] = 0.0,
    question: Annotated[
        str, typer.Option(help="The question after each window (long-doc).", rich_help_panel=WORKLOAD)
    ] = DEFAULT_QUESTION,
    num_requests: Annotated[int, typer.Option(min=1, help="Requests to send.", rich_help_panel=LOAD)] = 100,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Most requests in flight (default: no limit).", rich_help_panel=LOAD)
    ] = None,
    request_rate: Annotated[
        float, typer.Option(help="Poisson arrivals per second; inf sends all at once.", rich_help_panel=LOAD)
    ] = math.inf,
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of the lengths, prompts and arrivals (and sampling, "
            "seed + request index, when --temperature > 0).",
            rich_help_panel=LOAD,
        ),
    ] = 0,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.", rich_help_panel=LOAD)] = 0.0,
    ignore_eos: Annotated[
        bool, typer.Option(help="Generate the requested length even past end-of-sequence.", rich_help_panel=LOAD)
    ] = True,
    timeout: Annotated[
        float,
        typer.Option(
            help="Seconds the whole run may take; unfinished requests are then cancelled and count as failed.",
            rich_help_panel=LOAD,
        ),
    ] = 600.0,
    output_json: Annotated[
        Path | None, typer.Option(dir_okay=False, help="Also write the result as JSON to this file.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of tables.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a live progress display on stderr.")] = True,
    tls_dir: TlsDir = None,
    insecure: Insecure = False,
) -> None:
    """Measure a running router or gateway, as `vllm bench serve` measures a server.

    Reports request and token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).
    Tables go to stdout (JSON with --json); the exit status is 1 when any request failed.
    """
    from infinite_llm.bench.runner import LoadConfig

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the display
    try:
        load = LoadConfig(concurrency=concurrency, request_rate=request_rate, seed=seed, timeout_s=timeout)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if dataset is not DatasetKind.synthetic and dataset_path is None:
        raise typer.BadParameter(f"--dataset {dataset.value} needs --dataset-path", param_hint="--dataset-path")
    tls = load_cli_tls("client", tls_dir, insecure) if backend is Backend.router else None
    the_target = _target(backend, target, model, api_key, tls)
    settings = {
        "backend": backend.value,
        "target": the_target.address,
        "model": model,
        "dataset": dataset.value,
        "dataset_path": str(dataset_path) if dataset_path else None,
        "num_requests": num_requests,
        "input_len": None if dataset is DatasetKind.jsonl else input_len or DEFAULT_INPUT_LEN[dataset.value],
        "output_len": output_len,
        "range_ratio": range_ratio,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "seed": seed,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "timeout_s": timeout,
    }
    requests = _prepare(the_target, dataset, dataset_path, settings, question)
    settings["model"] = the_target.served_model()  # what ran, also when the requests named none
    sampling = _sampling(temperature, ignore_eos, seed)
    records, duration = asyncio.run(_run(the_target, requests, sampling, load, progress))
    _report(records, duration, settings, output_json, json_output)


def _target(
    backend: Backend, target: str | None, model: str | None, api_key: str | None, tls: TlsConfig | None = None
) -> Target:
    from infinite_llm.bench.targets import GatewayTarget, RouterTarget

    address = target or DEFAULT_TARGETS[backend.value]
    if backend is Backend.router:
        return RouterTarget(address, model, api_key, tls)
    return GatewayTarget(address, model, api_key)


def _prepare(
    target: Target, dataset: DatasetKind, path: Path | None, settings: dict, question: str
) -> list[BenchRequest]:
    """The requests; exit 2 for an unusable dataset, 1 when the target cannot tokenize or be probed."""
    from infinite_llm.bench import datasets
    from infinite_llm.bench.targets import TargetError, word_sample

    n, out_len, ratio, seed = (settings[k] for k in ("num_requests", "output_len", "range_ratio", "seed"))
    try:
        if dataset is DatasetKind.jsonl:
            return datasets.jsonl(path, n, out_len)
        text = path.read_text(encoding="utf-8", errors="replace") if path else word_sample()
        with err.status(f"preparing {n} prompts with the {target.name} at {target.address}..."):
            with target.prompt_codec(text) as codec:
                if dataset is DatasetKind.synthetic:
                    return datasets.synthetic(codec, n, settings["input_len"], out_len, ratio, seed)
                return datasets.long_doc(codec, text, n, settings["input_len"], out_len, ratio, seed, question)
    except ValueError as e:  # a jsonl file's own fault names its flag alone; cutting prompts involves both
        flags = "--dataset-path" if dataset is DatasetKind.jsonl else "--dataset-path / --input-len"
        raise typer.BadParameter(str(e), param_hint=flags) from None
    except TargetError as e:
        err.print(f"[red]error:[/red] {e}", highlight=False)
        raise typer.Exit(1) from None


def _sampling(temperature: float, ignore_eos: bool, seed: int) -> Callable[[int], dict]:
    """Request ``i``'s sampling keywords: seeded per request when sampling, so a rerun samples the same."""

    def sampling(i: int) -> dict:
        return {"temperature": temperature, "ignore_eos": ignore_eos, **({"seed": seed + i} if temperature else {})}

    return sampling


async def _run(
    target: Target, requests: list[BenchRequest], sampling: Callable[[int], dict], load: LoadConfig, show: bool
) -> tuple[list[RequestRecord], float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from infinite_llm.bench.runner import run_load

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, disable=not show) as bar:
        task = bar.add_task(f"{target.name} {target.address}", total=len(requests), failed=0)
        failed = 0

        def done(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            bar.update(task, advance=1, failed=failed)

        async with target:
            return await run_load(target, requests, sampling, load, done)


def _report(
    records: list[RequestRecord], duration: float, settings: dict, output_json: Path | None, json_output: bool
) -> None:
    from infinite_llm.bench.metrics import summarize
    from infinite_llm.bench.report import print_summary, to_json

    summary = summarize(records, duration)
    result = to_json(summary, settings)
    if output_json is not None:
        output_json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if json_output:
        print(json.dumps(result, indent=2))
    else:
        print_summary(summary, settings, Console())
    if summary.failed:
        raise typer.Exit(1)
