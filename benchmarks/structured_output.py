"""Decode tokens/s at batch 16 with and without structured output (a JSON schema per request), one run.

Both sides run in this process, interleaved, on the same engine and weights (the default SmolLM2-135M-Instruct
in fp32 on CPU, or ``--device cuda``). Decode is isolated from prefill by timing every engine step after the
first (the batch's prompts fit one prefill step): tok/s is the batch over the median decode step time of
``--repeats`` runs after a warm-up (a median of single steps shrugs off bursts of load elsewhere on a shared
machine, which a whole run's time does not). The schema forces a long value (40 short strings), so every constrained
request decodes all ``--tokens`` tokens under its mask. The issue's target: constrained costs <= 10%.
A third line times the same constrained batch with the masks computed after the forward on the engine's
thread (``ComputeOnWait``) instead of on a worker thread during it (the engine's default), to show what the
overlap buys.

Run: ``.venv/bin/python benchmarks/structured_output.py`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from infinite_llm.core.constraints import ComputeOnWait
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


def decode_step_seconds(engine: LLMEngine, prompt: list[int], batch: int, n: int, schema: str | None) -> list[float]:
    """The time of each decode step of ``batch`` copies of ``prompt`` run to ``n`` new tokens (step 1 is the
    prefill of every prompt and samples the first token; steps 2..n each decode one token per sequence)."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=schema is None, json_schema=schema)
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    times, finished = [], {}
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        finished.update((o.request_id, o) for o in outs if o.finished)
    assert all(len(finished[i].token_ids) == n for i in ids), [len(o.token_ids) for o in finished.values()]
    assert len(times) == n, len(times)  # one prefill step, then one step per token
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    engine = LLMEngine.from_pretrained(config=EngineConfig(device=args.device, max_num_seqs=max(args.batch, 16)))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": ASK}])
    decode_step_seconds(engine, prompt, args.batch, 4, SCHEMA)  # warm-up: builds the llguidance tokenizer once
    decode_step_seconds(engine, prompt, args.batch, 4, None)
    overlapped, after_forward = engine.runner.mask_prefetch, ComputeOnWait()
    steps: dict[str, list[float]] = {"free": [], "constrained": [], "serial": []}
    for _ in range(args.repeats):  # interleaved, so a burst of load elsewhere hits every side alike
        steps["free"] += decode_step_seconds(engine, prompt, args.batch, args.tokens, None)
        steps["constrained"] += decode_step_seconds(engine, prompt, args.batch, args.tokens, SCHEMA)
        engine.runner.mask_prefetch = after_forward
        steps["serial"] += decode_step_seconds(engine, prompt, args.batch, args.tokens, SCHEMA)
        engine.runner.mask_prefetch = overlapped
    free, constrained, serial = (args.batch / statistics.median(steps[k]) for k in ("free", "constrained", "serial"))
    how = f"{args.tokens} new tokens, median step of {args.repeats} runs, {args.device}"
    print(f"decode tok/s at batch {args.batch} ({how}):")
    print(f"  unconstrained              {free:10.1f}")
    print(f"  json_schema (llguidance)   {constrained:10.1f}   cost {(1 - constrained / free) * 100:+.1f}%")
    print(
        f"  json_schema, masks after the forward (no overlap) {serial:10.1f}   cost {(1 - serial / free) * 100:+.1f}%"
    )


if __name__ == "__main__":
    main()
