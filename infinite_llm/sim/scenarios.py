"""Settings the simulator runs, and the comparison with the paper's ratios.

``paper`` reproduces the paper's testbed (PAPER.md "Evaluation"): 32 accelerators as 4 nodes x 8,
LLaMA2-7B/13B/70B, a short-context and a long-context trace (contexts up to 2,000K tokens). Per model:
``pooled`` (Infinite-LLM: instances of the model's small parallel shape, KV anywhere through the real
placement and planner), ``static`` (vLLM-multi: the same instances, KV on the home only) and ``single``
(vLLM-single: one instance over every accelerator, TP=8 within a node x PP=4 across nodes, KV on all of
them). ``tiny`` is this machine's setting (the CPU calibration, SmolLM2-135M, 2 instances of small KV
memory): quick, and what the tests run.

The pooled / static ratio on the short trace is also measured open-loop (:func:`max_rate`): requests arrive
as a Poisson process, and each mode's throughput is taken at the highest request rate whose p90 queueing
delay stays within ``Setting.slo_wait_s``. Saturated (every request at time 0), round-robin routing makes
every instance alike (all memory-bound); below saturation the instances that drew a document are memory-bound
while the others leave memory idle, which is the debtor/creditor mix PAPER.md's gain needs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.services.manager.capacity import CapacityView
from infinite_llm.services.manager.placement import reserve_placement
from infinite_llm.sim.calibration import Calibration
from infinite_llm.sim.cluster import SimServers
from infinite_llm.sim.models import get_model
from infinite_llm.sim.simulator import SimConfig, SimResult, Simulator
from infinite_llm.sim.traces import TraceSpec, generate, with_arrivals

MAX_BACKLOG = 0.05  # a sustained open-loop rate leaves at most this share of its window's arrivals queued

# PAPER.md "Evaluation": (low, high) of each ratio the paper reports.
PAPER_RATIOS = {
    "pooled/static short": (1.35, 1.73),
    "pooled/static short, open-loop": (1.35, 1.73),
    "pooled/single short": (1.4, 5.3),
    "pooled/single long": (1.4, 3.4),
    "pooled/single long, prompt+output tokens": (1.4, 3.4),  # the paper does not say which tokens it counts
    "longest context pooled/static": (2.0, 19.0),
}


@dataclass(frozen=True)
class ModelRun:
    """One model of a setting: its instances' tensor-parallel degree and the simulated horizon (seconds)."""

    model: str
    tp: int
    horizon_s: float


@dataclass(frozen=True)
class Setting:
    """A cluster and its traces. ``kv_memory_bytes``: per instance, for a fitted calibration (else derived
    from the accelerators); ``requests_per_instance``: trace size (enough that queues last the horizon);
    ``slo_wait_s``: the p90 queueing delay (seconds) an open-loop rate must keep (:func:`max_rate`), over
    ``open_loop_horizon_s`` of simulated time (longer than the saturated runs' horizon: a rate just past
    what a cluster sustains takes minutes to show as a growing queue)."""

    name: str
    calibration: str
    nodes: int
    per_node: int
    models: tuple[ModelRun, ...]
    single_tp: int
    single_pp: int
    max_context: int
    requests_per_instance: int
    short_fraction_docs: float = 0.02
    short_doc_max: int = 100_000
    long_fraction_docs: float = 0.05
    long_doc_min: int = 100_000
    conversation_max: int = 16_384
    kv_memory_bytes: float | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    tick_s: float = 0.5
    slo_wait_s: float = 5.0
    rate_search_steps: int = 7
    open_loop_horizon_s: float = 480.0
    admit_bypass_s: float = 0.0  # SimConfig.admit_bypass_s of every mode (0: strict FCFS)

    @property
    def accelerators(self) -> int:
        return self.nodes * self.per_node


SETTINGS = {
    "paper": Setting(
        name="paper",
        calibration="a100",
        nodes=4,
        per_node=8,
        models=(ModelRun("llama2-7b", 1, 120.0), ModelRun("llama2-13b", 2, 120.0), ModelRun("llama2-70b", 4, 300.0)),
        single_tp=8,
        single_pp=4,
        max_context=2_000_000,
        requests_per_instance=600,
    ),
    "tiny": Setting(
        name="tiny",
        calibration="cpu",
        nodes=1,
        per_node=2,
        models=(ModelRun("smollm2-135m", 1, 600.0),),
        single_tp=1,
        single_pp=1,
        max_context=4_096,
        requests_per_instance=12,
        short_fraction_docs=0.1,
        short_doc_max=1_800,
        long_fraction_docs=0.25,
        long_doc_min=2_000,
        conversation_max=512,
        kv_memory_bytes=2048 * 46080,  # 2,048 tokens of SmolLM2 fp32 KV per instance
        max_num_seqs=8,
        max_num_batched_tokens=512,
        tick_s=2.0,
        slo_wait_s=30.0,  # a CPU step is ~0.1-1 s
        open_loop_horizon_s=2400.0,
    ),
}


@dataclass(frozen=True)
class OpenLoop:
    """One mode's open-loop result: the highest Poisson request rate (requests per second) found that the
    cluster sustains (:func:`max_rate`), and the run at that rate (``None`` when even the lowest rate tried
    was not sustained: ``rate`` is then 0). ``at_ceiling``: every rate tried was sustained, so ``rate`` is a
    lower bound set by the search's range, not by the SLO."""

    rate: float
    result: SimResult | None
    at_ceiling: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s if self.result is not None else 0.0


@dataclass(frozen=True)
class ModelReport:
    """Everything printed for one model: instance shapes, per-trace results, longest contexts."""

    model: str
    instances: int
    tp: int
    instance_tokens: int
    single_tokens: int
    results: dict[tuple[str, str], SimResult]  # (trace, mode) -> result
    longest_pooled: int
    longest_static: int
    max_num_seqs: int = 256
    open_loop: dict[str, OpenLoop] | None = None  # mode -> its highest rate within the SLO (short trace)
    slo_wait_s: float = 0.0

    def ratios(self) -> dict[str, float]:
        def tput(trace: str, mode: str) -> float:
            return self.results[(trace, mode)].tokens_per_s

        open_loop = {}
        if self.open_loop is not None:
            # output tokens per second each delivers at its highest sustained rate (not the rates' ratio: a
            # rate whose queue holds may still be decoding a growing batch); undefined when either found none
            pooled, static = self.open_loop["pooled"].tokens_per_s, self.open_loop["static"].tokens_per_s
            if pooled > 0 and static > 0:
                open_loop["pooled/static short, open-loop"] = pooled / static
        return {
            "pooled/static short": tput("short", "pooled") / tput("short", "static"),
            **open_loop,
            "pooled/single short": tput("short", "pooled") / tput("short", "single"),
            "pooled/single long": tput("long", "pooled") / tput("long", "single"),
            "pooled/single long, prompt+output tokens": self.results[("long", "pooled")].all_tokens_per_s
            / self.results[("long", "single")].all_tokens_per_s,
            "longest context pooled/static": self.longest_pooled / self.longest_static,
        }


def traces(setting: Setting, instance_tokens: int, instances: int, seed: int) -> dict[str, TraceSpec]:
    """The short-context and long-context trace specs of one model run (documents sized to the cluster)."""
    n = setting.requests_per_instance * instances
    pool = min(setting.max_context, instance_tokens * instances)
    short_max = max(min(setting.short_doc_max, int(0.9 * instance_tokens)), 2)
    return {
        "short": TraceSpec("short", n, setting.short_fraction_docs, min(8_000, short_max), short_max),
        "long": TraceSpec("long", n, setting.long_fraction_docs, min(setting.long_doc_min, pool), pool),
    }


def run_model(
    setting: Setting, calibration: Calibration, run: ModelRun, seed: int, planner: bool = True, open_loop: bool = True
) -> ModelReport:
    """Simulate one model of ``setting``: 2 traces x (pooled, static, single), the longest contexts, and with
    ``open_loop`` the short trace's highest rate within the SLO for pooled and static (:func:`max_rate`)."""
    model = get_model(run.model)
    instances = setting.accelerators // run.tp
    cost = calibration.instance_cost(model, run.tp, 1, setting.kv_memory_bytes)
    single_memory = None if setting.kv_memory_bytes is None else setting.kv_memory_bytes * instances
    single = calibration.instance_cost(model, setting.single_tp, setting.single_pp, single_memory)
    base = SimConfig(
        "pooled",
        instances,
        cost,
        block_size=setting.block_size,
        max_num_seqs=setting.max_num_seqs,
        max_num_batched_tokens=setting.max_num_batched_tokens,
        tick_s=setting.tick_s,
        planner=planner,
        admit_bypass_s=setting.admit_bypass_s,
    )
    configs = {
        "pooled": base,
        "static": replace(base, mode="static"),
        "single": replace(base, mode="static", num_instances=1, cost=single),
    }
    results = {}
    specs = traces(setting, cost.kv_capacity_tokens, instances, seed)
    requests = {name: generate(spec, seed) for name, spec in specs.items()}
    for trace_name in specs:
        for mode, config in configs.items():
            sim = Simulator(config, requests[trace_name], horizon_s=run.horizon_s)
            results[(trace_name, mode)] = asyncio.run(sim.run())
    rates = None
    if open_loop:
        mean_output = sum(r.output_tokens for r in requests["short"]) / len(requests["short"])
        rates = {
            mode: max_rate(
                configs[mode],
                specs["short"],
                seed,
                setting.open_loop_horizon_s,
                setting.slo_wait_s,
                results[("short", mode)].tokens_per_s / mean_output,
                setting.rate_search_steps,
            )
            for mode in ("pooled", "static")
        }
    return ModelReport(
        model=run.model,
        instances=instances,
        tp=run.tp,
        instance_tokens=cost.kv_capacity_tokens,
        single_tokens=single.kv_capacity_tokens,
        results=results,
        longest_pooled=longest_placeable(configs["pooled"], setting.max_context),
        longest_static=longest_placeable(configs["static"], setting.max_context),
        max_num_seqs=setting.max_num_seqs,
        open_loop=rates,
        slo_wait_s=setting.slo_wait_s,
    )


def max_rate(
    config: SimConfig,
    spec: TraceSpec,
    seed: int,
    horizon_s: float,
    slo_wait_s: float,
    saturation_rate: float,
    steps: int = 7,
    max_backlog: float = MAX_BACKLOG,
) -> OpenLoop:
    """The highest Poisson request rate (requests per second) that ``config`` sustains over ``horizon_s``:
    the p90 queueing delay of ``spec``'s requests within ``slo_wait_s``, and at most ``max_backlog`` of the
    window's arrivals still queued at the end (else the queue grows), by bisection over
    ``[0, 1.5] x saturation_rate`` (the closed run's completed requests per second) in ``steps`` runs
    (resolution ``1.5 / 2**steps`` of it), with the same seeded requests and arrival draws at every rate,
    so only the rate changes. The throughput at
    that rate is what an operator holding that latency gets (vLLM's and the paper's "throughput at a request
    rate"). Raises ``ValueError`` for a saturation rate or an SLO <= 0."""
    if not saturation_rate > 0 or not slo_wait_s > 0:
        raise ValueError(f"saturation rate and SLO must be > 0, got {saturation_rate} and {slo_wait_s}")
    lo, hi, best, ceiling = 0.0, 1.5 * saturation_rate, None, True
    for _ in range(steps):
        rate = (lo + hi) / 2
        n = int(rate * horizon_s * 1.2) + 16  # arrivals outlast the horizon
        sim = Simulator(config, with_arrivals(generate(replace(spec, n=n), seed), rate, seed), horizon_s=horizon_s)
        result = asyncio.run(sim.run())
        arrived = rate * (horizon_s - sim.wait_from_s)  # expected arrivals whose waits count
        if result.wait_p90_s <= slo_wait_s and result.backlog <= max_backlog * arrived:
            lo, best = rate, result
        else:
            hi, ceiling = rate, False
    return OpenLoop(lo, best, at_ceiling=ceiling and best is not None)


def longest_placeable(config: SimConfig, max_context: int) -> int:
    """The longest context (tokens, at most ``max_context``, whole rBlocks) the real placement accepts for
    one sequence on an empty cluster of ``config``: home only in ``static`` mode, anywhere in ``pooled``."""
    reachable = config.capacity_blocks * (config.num_instances if config.mode == "pooled" else 1)
    blocks = min(reachable, max_context // config.block_size)
    assert asyncio.run(_fits(config, blocks)) and not asyncio.run(_fits(config, reachable + 1))
    return blocks * config.block_size


async def _fits(config: SimConfig, n_blocks: int) -> bool:
    servers = SimServers({f"s{i}": config.capacity_blocks for i in range(config.num_instances)})
    view = CapacityView()
    for server_id, capacity in servers.capacity.items():
        view.add(server_id, capacity)
    lenders = () if config.mode == "static" else None
    try:
        await reserve_placement(servers, view, "probe", n_blocks, "s0", homes=("s0",), lenders=lenders)
    except CapacityExhausted:
        return False
    return True


def compare(value: float, paper: tuple[float, float]) -> str:
    """``within`` the paper's range, or how far outside it (percent of the nearer end)."""
    low, high = paper
    if low <= value <= high:
        return "within the paper's range"
    end = low if value < low else high
    return f"{abs(value / end - 1) * 100:.0f}% {'below' if value < low else 'above'} the paper's range"


def report_lines(report: ModelReport, single_shape: str) -> list[str]:
    """The printed lines of one model (a contract: tests and the README read them)."""
    r = report.results
    lines = [
        f"{report.model}: {report.instances} instances of TP={report.tp} ({report.instance_tokens:,} KV tokens "
        f"each, pool {report.instance_tokens * report.instances:,}); single {single_shape} "
        f"({report.single_tokens:,})"
    ]
    for trace in ("short", "long"):
        p, s, g = r[(trace, "pooled")], r[(trace, "static")], r[(trace, "single")]
        lines.append(
            f"  {trace}: pooled {p.tokens_per_s:,.0f} tok/s (migrations {p.migrations}, refused {p.refused}), static "
            f"{s.tokens_per_s:,.0f} tok/s (refused {s.refused}), single {g.tokens_per_s:,.0f} tok/s; "
            f"prompt+output {p.all_tokens_per_s:,.0f} / {s.all_tokens_per_s:,.0f} / {g.all_tokens_per_s:,.0f} tok/s"
        )
    if report.open_loop is not None:
        p, s = report.open_loop["pooled"], report.open_loop["static"]
        lines.append(
            f"  short open-loop (highest rate sustained with p90 queueing delay <= {report.slo_wait_s:g} s): "
            f"pooled {_open_loop_text(p)}; static {_open_loop_text(s)}"
        )
    for trace in ("short", "long"):
        p, s, g = r[(trace, "pooled")], r[(trace, "static")], r[(trace, "single")]
        lines.append(
            f"  {trace} regime: mean batch {p.mean_batch:.0f} / {s.mean_batch:.0f} / {g.mean_batch:.0f} of "
            f"{report.max_num_seqs}, home KV used {p.home_used:.0%} / {s.home_used:.0%} / {g.home_used:.0%} "
            "(pooled / static / single)"
        )
    for name, value in report.ratios().items():
        low, high = PAPER_RATIOS[name]
        lines.append(f"  {name} {value:.2f}x (paper {low:g}-{high:g}x): {compare(value, PAPER_RATIOS[name])}")
        if name == "pooled/static short" and value < low:
            lines.append(f"    why: {regime_note(r[('short', 'pooled')], r[('short', 'static')], report.max_num_seqs)}")
    return lines


def _open_loop_text(o: OpenLoop) -> str:
    if o.result is None:
        return "no rate tried was sustained"
    r = o.result
    bound = "at least " if o.at_ceiling else ""
    ceiling = ", the search's ceiling" if o.at_ceiling else ""
    return (
        f"{bound}{o.rate:.3g} req/s{ceiling}, {r.tokens_per_s:,.0f} tok/s (p90 wait {r.wait_p90_s:.1f} s, mean "
        f"batch {r.mean_batch:.0f}, home KV used {r.home_used:.0%})"
    )


def regime_note(pooled: SimResult, static: SimResult, max_num_seqs: int) -> str:
    """Why pooling gains less over static instances than the paper, read from the two runs (PAPER.md
    "Problem": the gain is memory that instances serving short requests leave idle, lent to instances whose
    batch long contexts hold down; none of that exists when every static instance is memory-bound)."""
    notes = []
    if static.home_used >= 0.8 and static.mean_batch < 0.9 * max_num_seqs:
        notes.append(
            f"static instances are memory-bound (home KV {static.home_used:.0%} used, batch "
            f"{static.mean_batch:.0f} of {max_num_seqs}): no instance leaves memory idle, so pooling only moves "
            "KV between full homes"
        )
    elif static.mean_batch >= 0.9 * max_num_seqs:
        notes.append(
            f"static instances are batch-capped (batch {static.mean_batch:.0f} of {max_num_seqs}, home KV "
            f"{static.home_used:.0%} used): long contexts rarely hold a batch down, so there is little to lend for"
        )
    else:
        notes.append(
            f"static instances run batch {static.mean_batch:.0f} of {max_num_seqs} at home KV {static.home_used:.0%}"
        )
    if static.refused > pooled.refused:
        more = static.refused - pooled.refused
        notes.append(
            f"static refused {more} more request{'s' if more > 1 else ''} than pooled: larger than a home, which "
            "pooled serves (their prefill and memory count against pooled's output tokens)"
        )
    return "; ".join(notes)


def single_shape(setting: Setting) -> str:
    return f"TP={setting.single_tp} x PP={setting.single_pp}"
