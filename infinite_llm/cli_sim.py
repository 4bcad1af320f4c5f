"""``infinite-llm simulate``: the paper-scale simulator (:mod:`infinite_llm.sim`) from the command line.

Prints, per model of the setting, the throughput of pooled KV (the real placement and planner), static
per-instance KV and one big instance on a short- and a long-context trace, then the ratios beside the
paper's (PAPER.md "Evaluation"); with ``--open-loop`` (the default) also the short trace's pooled / static
ratio at the highest Poisson request rate each keeps within a queueing-delay SLO. Pure simulation: no
model, no network; the output is deterministic in ``--seed``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer


def simulate(
    setting: Annotated[str, typer.Option(help="paper (32 GPUs, LLaMA2-7B/13B/70B) or tiny (this CPU, SmolLM2).")] = (
        "paper"
    ),
    calibration: Annotated[
        str | None,
        typer.Option(help="a100, h200, cpu or a calibration YAML file (default: the setting's own)."),
    ] = None,
    model: Annotated[list[str] | None, typer.Option(help="Only these models of the setting (repeatable).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the traces.")] = 0,
    planner: Annotated[bool, typer.Option(help="Run the manager's planner in pooled mode (off: placement only).")] = (
        True
    ),
    open_loop: Annotated[
        bool,
        typer.Option(
            help="Also search each mode's highest Poisson request rate within the SLO on the short trace "
            "(about 7 more runs per mode and model)."
        ),
    ] = True,
    slo_wait_s: Annotated[
        float | None,
        typer.Option(
            "--slo-wait-s", min=0.001, help="p90 queueing delay (s) of the open-loop search (default: the setting's)."
        ),
    ] = None,
    admit_bypass_s: Annotated[
        float,
        typer.Option(
            "--admit-bypass-s",
            min=0.0,
            help="Seconds a queue head that does not fit lets later requests that fit pass it, in every mode "
            "(0: strict FCFS, as vLLM).",
        ),
    ] = 0.0,
) -> None:
    """Simulate pooled vs static vs one-big-instance serving and print the ratios beside the paper's."""
    from infinite_llm.sim.calibration import load_calibration
    from infinite_llm.sim.scenarios import SETTINGS, report_lines, run_model, single_shape

    if setting not in SETTINGS:
        raise typer.BadParameter(f"unknown setting {setting!r}; use {' or '.join(SETTINGS)}", param_hint="--setting")
    chosen = SETTINGS[setting]
    if slo_wait_s is not None:
        chosen = replace(chosen, slo_wait_s=slo_wait_s)
    if admit_bypass_s:
        chosen = replace(chosen, admit_bypass_s=admit_bypass_s)
    try:
        cal = load_calibration(calibration or chosen.calibration)
    except (ValueError, KeyError, TypeError) as e:
        raise typer.BadParameter(str(e), param_hint="--calibration") from None
    runs = [r for r in chosen.models if not model or r.model in model]
    if not runs:
        known = ", ".join(r.model for r in chosen.models)
        raise typer.BadParameter(
            f"no model of setting {setting!r} matches {model}; known: {known}", param_hint="--model"
        )
    typer.echo(
        f"simulate: setting {chosen.name}, calibration {cal.name} ({cal.source}), {chosen.accelerators} "
        f"accelerators ({chosen.nodes} nodes x {chosen.per_node}), seed {seed}, planner {'on' if planner else 'off'}"
    )
    for run in runs:
        try:
            report = run_model(chosen, cal, run, seed, planner=planner, open_loop=open_loop)
        except ValueError as e:  # a model that does not fit, a fitted calibration for another model
            raise typer.BadParameter(str(e), param_hint="--calibration") from None
        for line in report_lines(report, single_shape(chosen)):
            typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
