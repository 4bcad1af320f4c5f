"""Decode tokens/s at batch 16 with and without structured output (a JSON schema per request), one run.

Every side runs in this process on its own engine over the same weights (the default SmolLM2-135M-Instruct in
fp32 on CPU, or ``--device cuda``), and the sides are stepped in turn, one engine step each (the first side
changes with each repeat), so a burst of load elsewhere on a shared machine hits neighbouring steps of every
side alike. Decode is isolated from prefill by timing every engine step after the first (the batch's prompts
fit one prefill step). The headline cost is the median over all decode steps of a constrained step's time
over the unconstrained step taken just before or after it (paired steps), which holds still on a noisy machine
where whole-run times swing by 10%; tok/s is the batch over a side's median decode step time, and in
brackets the same at the 10th-percentile step (the machine's quiet moments). The schema forces a long value
(40 short strings), so every constrained request decodes all ``--tokens`` tokens under its mask. The issue's
target: constrained costs <= 10%.

Wall time on a shared 2-core machine moves by several percent between runs, so the script also prints CPU
time: the process's per decode step on each side (on a loaded machine this includes torch's intra-op threads
spinning while they wait for a core), and the mask work's own per step: the llguidance bitmasks (wall time of
the parallel executor's fill), advancing the matchers, and applying the masks to the logits (timed apart, on
one thread). ``--other-prefetch-too`` adds a side with the engine's other mask schedule: on a CPU device with
local KV the engine computes the masks right after the forward, and that side computes them on a worker
thread during it; on a GPU the reverse. It shows what the engine's choice buys.

Run: ``.venv/bin/python benchmarks/structured_output.py`` (a few minutes on 2 quiet CPU cores). Where other work
loads the machine, ``OMP_WAIT_POLICY=PASSIVE`` stops torch's waiting intra-op threads from spinning on the cores
the other processes want (at load average 10 on 2 cores: ~1 s decode steps instead of ~5 s); every side runs
under it alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from infinite_llm.core.constraints import StepMasks, TokenConstraint, apply_bitmasks, bitmask_words
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.engine.structured import GuidanceConstraint, GuidanceMaskPrefetch

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "names": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40, "maxItems": 40}
        },
        "required": ["names"],
    }
)
ASK = "List forty first names of people in a JSON object."


class TimedConstraint(GuidanceConstraint):
    """A :class:`GuidanceConstraint` that adds the CPU time of ``accept`` to ``seconds["accept"]``."""

    def __init__(self, inner: GuidanceConstraint, seconds: dict[str, float]) -> None:
        super().__init__(inner.matcher)
        self.seconds = seconds

    def accept(self, token_id: int) -> None:
        t = time.thread_time()
        super().accept(token_id)
        self.seconds["accept"] += time.thread_time() - t


class TimedPrefetch(GuidanceMaskPrefetch):
    """The engine's prefetch that adds the wall time of each step's fill (on whichever thread; the executor's
    threads run in parallel, so thread CPU time would miss them) to ``seconds["fill"]``."""

    def __init__(self, overlap: bool, num_threads: int, seconds: dict[str, float]) -> None:
        super().__init__(overlap, num_threads)
        self.seconds = seconds

    def fill(self, constraints: list[TokenConstraint | None], vocab_size: int) -> StepMasks | None:
        t = time.perf_counter()
        try:
            return super().fill(constraints, vocab_size)
        finally:
            self.seconds["fill"] += time.perf_counter() - t


def stepped_in_turn(
    engines: list[LLMEngine], prompt: list[int], batch: int, n: int, schemas: list[str | None]
) -> list[list[tuple[float, float]]]:
    """Per engine, (wall, process CPU) seconds of each decode step of ``batch`` copies of ``prompt`` run to
    ``n`` new tokens under ``schemas[i]`` (step 1 is the prefill of every prompt and samples the first token;
    steps 2..n each decode one token per sequence); the engines take one step each in turn."""
    ids = []
    for engine, schema in zip(engines, schemas, strict=True):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=schema is None, json_schema=schema)
        ids.append([engine.add_request(prompt, params) for _ in range(batch)])
    times: list[list[tuple[float, float]]] = [[] for _ in engines]
    finished: list[dict] = [{} for _ in engines]
    while any(e.has_unfinished() for e in engines):
        for i, engine in enumerate(engines):
            t, c = time.perf_counter(), time.process_time()
            outs = engine.step()
            times[i].append((time.perf_counter() - t, time.process_time() - c))
            finished[i].update((o.request_id, o) for o in outs if o.finished)
    for i in range(len(engines)):
        assert all(len(finished[i][r].token_ids) == n for r in ids[i]), [len(o.token_ids) for o in finished[i].values()]
        assert len(times[i]) == n, len(times[i])  # one prefill step, then one step per token
    return [t[1:] for t in times]


def apply_seconds(engine: LLMEngine, batch: int, repeats: int = 50) -> float:
    """CPU seconds of one :func:`apply_bitmasks` on ``[batch, vocab_size]`` fp32 logits with every row
    constrained (its cost does not depend on the bits), run on one thread so that no spinning of torch's
    idle intra-op threads is counted."""
    vocab_size = engine.model_config.vocab_size
    logits = torch.randn(batch, vocab_size)
    words = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_words(vocab_size)), dtype=torch.int32)
    masks = StepMasks(list(range(batch)), words)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        apply_bitmasks(logits, masks)
        t = time.thread_time()
        for _ in range(repeats):
            apply_bitmasks(logits, masks)
        return (time.thread_time() - t) / repeats
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--other-prefetch-too", action="store_true", help="also time the engine's other mask schedule (see above)"
    )
    args = ap.parse_args()
    free = LLMEngine.from_pretrained(config=EngineConfig(device=args.device, max_num_seqs=max(args.batch, 16)))
    mask_cpu = {"fill": 0.0, "accept": 0.0}
    sides = {"free": free}
    for side in ("constrained", "other") if args.other_prefetch_too else ("constrained",):
        engine = LLMEngine(free.runner.model, free.tokenizer, free.config)  # the same weights
        make = engine.grammars.constraint
        engine.grammars.constraint = lambda schema, make=make: TimedConstraint(make(schema), mask_cpu)
        default = engine.runner.mask_prefetch
        schedule = default.overlap if side == "constrained" else not default.overlap
        engine.runner.mask_prefetch = TimedPrefetch(schedule, default.num_threads, mask_cpu)
        sides[side] = engine
    overlap = sides["constrained"].runner.mask_prefetch.overlap  # the engine's own schedule
    names, engines = list(sides), list(sides.values())
    schemas = [None if side == "free" else SCHEMA for side in names]
    prompt = free.tokenizer.encode_chat([{"role": "user", "content": ASK}])
    stepped_in_turn(engines, prompt, args.batch, 4, schemas)  # warm-up: builds the llguidance tokenizer once
    runs: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in sides}
    fill, accept = [], []
    for r in range(args.repeats):
        order = list(range(r % len(engines), len(engines))) + list(range(r % len(engines)))  # who steps first
        mask_cpu.update(fill=0.0, accept=0.0)
        times = stepped_in_turn(
            [engines[i] for i in order], prompt, args.batch, args.tokens, [schemas[i] for i in order]
        )
        for i, t in zip(order, times, strict=True):
            runs[names[i]].append(t)
        num_constrained = len(engines) - 1  # the fill and accept times are summed over the constrained sides
        fill.append(mask_cpu["fill"] / args.tokens / num_constrained)  # every step samples, the prefill step too
        accept.append(mask_cpu["accept"] / args.tokens / num_constrained)
    report(args, runs, overlap)
    report_cpu(args, runs, statistics.median(fill), statistics.median(accept), apply_seconds(free, args.batch))


def _step(runs: list[list[tuple[float, float]]], q: float = 0.5, cpu: bool = False) -> float:
    """The ``q`` quantile of the steps' wall (or CPU) seconds in ``runs``."""
    steps = sorted(step[cpu] for run in runs for step in run)
    return steps[min(int(q * len(steps)), len(steps) - 1)]


def report(args: argparse.Namespace, runs: dict[str, list[list[tuple[float, float]]]], overlap: bool) -> None:
    """Per side: tok/s at the median step and the 10th-percentile step (the machine's quiet moments); the cost
    over paired steps (each constrained decode step against the unconstrained one taken next to it) as median
    and quartiles, and the cost between the sides' median (and 10th-percentile) steps."""
    how = f"{args.tokens} new tokens, {args.repeats} repeats, sides stepped in turn, {args.device}"
    print(f"decode tok/s at batch {args.batch} ({how}), median step [10th-percentile step]:")
    free, free_fast = _step(runs["free"]), _step(runs["free"], 0.1)
    schedules = ("masks after the forward", "masks during the forward")
    labels = {
        "free": "unconstrained",
        "constrained": f"json_schema (engine: {schedules[overlap]})",
        "other": f"json_schema ({schedules[not overlap]})",
    }
    width = max(len(labels[side]) for side in runs)
    print(f"  {labels['free']:<{width}} {args.batch / free:8.1f} [{args.batch / free_fast:8.1f}]")
    for side in [s for s in runs if s != "free"]:
        step, fast = _step(runs[side]), _step(runs[side], 0.1)
        paired = [
            c[0] / f[0] - 1
            for fr, cr in zip(runs["free"], runs[side], strict=True)
            for f, c in zip(fr, cr, strict=True)
        ]
        q = statistics.quantiles(paired, n=4)
        print(
            f"  {labels[side]:<{width}} {args.batch / step:8.1f} [{args.batch / fast:8.1f}]"
            f"   cost {statistics.median(paired) * 100:+.1f}% (paired steps; quartiles {q[0] * 100:+.1f}%,"
            f" {q[2] * 100:+.1f}%), median steps {(1 - free / step) * 100:+.1f}% [{(1 - free_fast / fast) * 100:+.1f}%]"
        )


def report_cpu(args: argparse.Namespace, runs: dict, fill: float, accept: float, apply: float) -> None:  # noqa: ANN001
    """CPU time per decode step: the whole process on each side, and the mask work alone."""
    free_cpu, con_cpu = _step(runs["free"], cpu=True), _step(runs["constrained"], cpu=True)
    print(
        f"CPU ms per decode step (process, median step): unconstrained {free_cpu * 1e3:.1f},"
        f" json_schema {con_cpu * 1e3:.1f} ({(con_cpu / free_cpu - 1) * 100:+.1f}%)"
    )
    work = fill + accept + apply
    free, free_fast = _step(runs["free"]), _step(runs["free"], 0.1)
    print(
        f"mask work ms per step (median run): {args.batch} bitmasks {fill * 1e3:.2f} (wall),"
        f" accept {accept * 1e3:.2f} (CPU),"
        f" apply {apply * 1e3:.2f}; total {work * 1e3:.2f} = {work / free * 100:.1f}%"
        f" [{work / free_fast * 100:.1f}%] of an unconstrained step's wall time"
    )


if __name__ == "__main__":
    main()
