"""Decode tokens/s at batch 16 with and without structured output (a JSON schema per request), one run.

Both sides run in this process, interleaved, on the same engine and weights (the default SmolLM2-135M-Instruct
in fp32 on CPU, or ``--device cuda``). Decode is isolated from prefill by timing each batch with ``--tokens``
and with 1 new token and dividing the extra tokens by the extra time; each figure is the best of
``--repeats`` runs after a warm-up. The schema forces a long value (40 short strings), so every constrained
request decodes all ``--tokens`` tokens under its mask. The issue's target: constrained costs <= 10%.
A third line times the same constrained batch with the masks computed after the forward on the engine's
thread (``ComputeOnWait``) instead of on a worker thread during it (the engine's default), to show what the
overlap buys.

Run: ``.venv/bin/python benchmarks/structured_output.py`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
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


def seconds(engine: LLMEngine, prompt: list[int], batch: int, n: int, schema: str | None) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=schema is None, json_schema=schema)
    t = time.perf_counter()
    outs = engine.generate([prompt] * batch, params)
    elapsed = time.perf_counter() - t
    assert all(len(o.token_ids) == n for o in outs), [len(o.token_ids) for o in outs]
    return elapsed


def decode_tok_s(engine: LLMEngine, prompt: list[int], batch: int, n: int, schema: str | None) -> float:
    """New tokens per second of decode alone: the ``n - 1`` extra tokens over the extra time."""
    extra = seconds(engine, prompt, batch, n, schema) - seconds(engine, prompt, batch, 1, schema)
    return batch * (n - 1) / extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    engine = LLMEngine.from_pretrained(config=EngineConfig(device=args.device, max_num_seqs=max(args.batch, 16)))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": ASK}])
    seconds(engine, prompt, args.batch, 4, SCHEMA)  # warm-up: builds the llguidance tokenizer once
    seconds(engine, prompt, args.batch, 4, None)
    overlapped, after_forward = engine.runner.mask_prefetch, ComputeOnWait()
    free = constrained = serial = 0.0
    for _ in range(args.repeats):  # interleaved, so a burst of load elsewhere hits every side alike
        free = max(free, decode_tok_s(engine, prompt, args.batch, args.tokens, None))
        constrained = max(constrained, decode_tok_s(engine, prompt, args.batch, args.tokens, SCHEMA))
        engine.runner.mask_prefetch = after_forward
        serial = max(serial, decode_tok_s(engine, prompt, args.batch, args.tokens, SCHEMA))
        engine.runner.mask_prefetch = overlapped
    print(f"decode tok/s at batch {args.batch} ({args.tokens} new tokens, best of {args.repeats}, {args.device}):")
    print(f"  unconstrained              {free:10.1f}")
    print(f"  json_schema (llguidance)   {constrained:10.1f}   cost {(1 - constrained / free) * 100:+.1f}%")
    print(
        f"  json_schema, masks after the forward (no overlap) {serial:10.1f}   cost {(1 - serial / free) * 100:+.1f}%"
    )


if __name__ == "__main__":
    main()
