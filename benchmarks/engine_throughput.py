"""Decode tokens/s of the engine vs HF transformers ``generate`` on the same model, batch 1 and 16.

Both sides run in this process, one after the other, on the same weights (the default SmolLM2-135M-Instruct
in fp32, CPU). Decode throughput is isolated from prefill by timing each run twice, with ``n`` and with 1 new
token, and dividing the extra tokens by the extra time. Run: ``.venv/bin/python benchmarks/engine_throughput.py``.
"""

from __future__ import annotations

import argparse
import time

import torch

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.models.registry import load_model_files, resolve_model

PROMPT_WORDS = "Summarise the plot of a novel about a lighthouse keeper who finds a message in a bottle. "


def prompts(tokenizer, batch: int) -> list[list[int]]:
    base = tokenizer.encode(PROMPT_WORDS * 3)
    return [base[i % 7 :] for i in range(batch)]  # slightly different lengths, as real traffic


def engine_seconds(engine: LLMEngine, ids: list[list[int]], n: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(ids, params)
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t


def hf_seconds(model, tokenizer, ids: list[list[int]], n: int) -> float:
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[0] * (width - len(i)) + i for i in ids])  # left padding, as HF expects
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == width + n
    return time.perf_counter() - t


def decode_step_seconds(run, ids, n: int) -> float:
    """Seconds of one decode step: ``run(ids, n)`` minus ``run(ids, 1)`` (the prefill), over ``n - 1`` steps."""
    run(ids, 2)  # warm-up
    full, one = run(ids, n), run(ids, 1)
    return max(full - one, 1e-9) / (n - 1)


def decode_rate(run, ids, n: int) -> float:
    return len(ids) / decode_step_seconds(run, ids, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--partitions", type=int, default=1, help="DistAttention partitions of the engine")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(None)
    cfg, state_dict, tokenizer = load_model_files(resolved, torch.float32)
    engine = LLMEngine.from_weights(cfg, state_dict, tokenizer, EngineConfig(num_partitions=a.partitions))
    hf = AutoModelForCausalLM.from_pretrained(
        str(resolved.path.parent), gguf_file=resolved.path.name, dtype=torch.float32
    ).eval()
    print(
        f"model {resolved.name}, fp32, CPU threads {torch.get_num_threads()}, {a.new_tokens} new tokens, "
        f"engine partitions {a.partitions}"
    )
    print(f"{'batch':>5s} {'engine tok/s':>13s} {'HF tok/s':>10s} {'engine/HF':>10s}")
    for batch in a.batches:
        ids = prompts(tokenizer, batch)
        ours = decode_rate(lambda i, n: engine_seconds(engine, i, n), ids, a.new_tokens)
        theirs = decode_rate(lambda i, n: hf_seconds(hf, tokenizer, i, n), ids, a.new_tokens)
        print(f"{batch:5d} {ours:13.1f} {theirs:10.1f} {ours / theirs:10.2f}")


if __name__ == "__main__":
    main()
