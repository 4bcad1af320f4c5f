"""Decode tokens/s at batch 16 with and without structured output (a JSON schema per request), one run.

Both sides run in this process, interleaved, on the same engine and weights (the default SmolLM2-135M-Instruct
in fp32 on CPU, or ``--device cuda``). Decode is isolated from prefill by timing every engine step after the
first (the batch's prompts fit one prefill step): tok/s is the batch over the median decode step time of all
``--repeats`` runs of a side after a warm-up (a median of single steps shrugs off bursts of load elsewhere on a
shared machine, which a whole run's time does not), and in brackets the same at the 10th-percentile step (the
machine's quiet moments). The cost is also given per repeat (each constrained run against the unconstrained
run just before it) as median and range, which shows how far the machine's noise moves it. The schema forces
a long value (40 short strings), so every constrained request decodes all ``--tokens`` tokens under its
mask. The issue's target: constrained costs <= 10%.

Wall time on a shared 2-core machine moves by several percent between runs, so the script also prints CPU
time: the process's per decode step on each side (on a loaded machine this includes torch's intra-op threads
spinning while they wait for a core), and the mask work's own per step: the llguidance bitmasks (on the
worker thread), advancing the matchers, and applying the masks to the logits (timed apart, on one thread).
``--no-overlap-too`` adds a side with the masks computed after the forward on the engine's thread
(``ComputeOnWait``) instead of on a worker thread during it (the engine's default), to show what the
overlap buys.

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

from infinite_llm.core.constraints import ComputeOnWait, StepMasks, TokenConstraint, apply_bitmasks, bitmask_words
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine

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


class TimedConstraint:
    """A :class:`TokenConstraint` that adds the CPU time of its calls (on whichever thread) to ``seconds``."""

    def __init__(self, inner: TokenConstraint, seconds: dict[str, float]) -> None:
        self.inner, self.seconds = inner, seconds

    def fill_bitmask(self, out: torch.Tensor) -> None:
        t = time.thread_time()
        self.inner.fill_bitmask(out)
        self.seconds["fill"] += time.thread_time() - t

    def accept(self, token_id: int) -> None:
        t = time.thread_time()
        self.inner.accept(token_id)
        self.seconds["accept"] += time.thread_time() - t


def decode_steps(
    engine: LLMEngine, prompt: list[int], batch: int, n: int, schema: str | None
) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each decode step of ``batch`` copies of ``prompt`` run to ``n`` new tokens
    (step 1 is the prefill of every prompt and samples the first token; steps 2..n each decode one token per
    sequence)."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=schema is None, json_schema=schema)
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    times, finished = [], {}
    while engine.has_unfinished():
        t, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        times.append((time.perf_counter() - t, time.process_time() - c))
        finished.update((o.request_id, o) for o in outs if o.finished)
    assert all(len(finished[i].token_ids) == n for i in ids), [len(o.token_ids) for o in finished.values()]
    assert len(times) == n, len(times)  # one prefill step, then one step per token
    return times[1:]


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
    ap.add_argument("--no-overlap-too", action="store_true", help="also time masks computed after the forward")
    args = ap.parse_args()
    engine = LLMEngine.from_pretrained(config=EngineConfig(device=args.device, max_num_seqs=max(args.batch, 16)))
    mask_cpu = {"fill": 0.0, "accept": 0.0}
    make = engine.grammars.constraint
    engine.grammars.constraint = lambda schema: TimedConstraint(make(schema), mask_cpu)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": ASK}])
    decode_steps(engine, prompt, args.batch, 4, SCHEMA)  # warm-up: builds the llguidance tokenizer once
    decode_steps(engine, prompt, args.batch, 4, None)
    overlapped, after_forward = engine.runner.mask_prefetch, ComputeOnWait()
    sides = ("free", "constrained", "serial") if args.no_overlap_too else ("free", "constrained")
    runs: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in sides}
    fill, accept = [], []
    for _ in range(args.repeats):  # interleaved, so a burst of load elsewhere hits every side alike
        runs["free"].append(decode_steps(engine, prompt, args.batch, args.tokens, None))
        mask_cpu.update(fill=0.0, accept=0.0)
        runs["constrained"].append(decode_steps(engine, prompt, args.batch, args.tokens, SCHEMA))
        fill.append(mask_cpu["fill"] / args.tokens)  # every step samples, the prefill step too
        accept.append(mask_cpu["accept"] / args.tokens)
        if args.no_overlap_too:
            engine.runner.mask_prefetch = after_forward
            runs["serial"].append(decode_steps(engine, prompt, args.batch, args.tokens, SCHEMA))
            engine.runner.mask_prefetch = overlapped
    report(args, runs)
    report_cpu(args, runs, statistics.median(fill), statistics.median(accept), apply_seconds(engine, args.batch))


def _step(runs: list[list[tuple[float, float]]], q: float = 0.5, cpu: bool = False) -> float:
    """The ``q`` quantile of the steps' wall (or CPU) seconds in ``runs``."""
    steps = sorted(step[cpu] for run in runs for step in run)
    return steps[min(int(q * len(steps)), len(steps) - 1)]


def report(args: argparse.Namespace, runs: dict[str, list[list[tuple[float, float]]]]) -> None:
    """Tok/s and cost per side at the median step and the 10th-percentile step (the machine's quiet moments),
    and the cost per repeat (each run against the unconstrained run before it): median and range."""
    how = f"{args.tokens} new tokens, {args.repeats} interleaved runs, {args.device}"
    print(f"decode tok/s at batch {args.batch} ({how}), median step [10th-percentile step]:")
    free, free_fast = _step(runs["free"]), _step(runs["free"], 0.1)
    print(f"  unconstrained              {args.batch / free:8.1f} [{args.batch / free_fast:8.1f}]")
    labels = {"constrained": "json_schema (llguidance)  ", "serial": "json_schema, masks after the forward"}
    for side in [s for s in runs if s != "free"]:
        step, fast = _step(runs[side]), _step(runs[side], 0.1)
        per_run = sorted(1 - _step([f]) / _step([c]) for f, c in zip(runs["free"], runs[side], strict=True))
        print(
            f"  {labels[side]} {args.batch / step:8.1f} [{args.batch / fast:8.1f}]"
            f"   cost {(1 - free / step) * 100:+.1f}% [{(1 - free_fast / fast) * 100:+.1f}%],"
            f" per run {statistics.median(per_run) * 100:+.1f}%"
            f" (min {per_run[0] * 100:+.1f}, max {per_run[-1] * 100:+.1f})"
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
        f"mask work CPU ms per step (median run): {args.batch} bitmasks {fill * 1e3:.2f}, accept {accept * 1e3:.2f},"
        f" apply {apply * 1e3:.2f}; total {work * 1e3:.2f} = {work / free * 100:.1f}%"
        f" [{work / free_fast * 100:.1f}%] of an unconstrained step's wall time"
    )


if __name__ == "__main__":
    main()
