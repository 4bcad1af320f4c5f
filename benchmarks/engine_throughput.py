"""Prefill and decode tokens/s of the engine vs HF transformers on the same model, side by side in one run.

Both sides run in this process, interleaved, on the same weights (the default SmolLM2-135M-Instruct in fp32,
CPU, ``torch.get_num_threads()`` threads). Every figure is the best (or with ``--stat median``, the median)
of ``--repeats`` timed runs after a warm-up, so a burst of load from another process on a small machine does
not decide a ratio.

- Prefill: one prompt of 512, 2,048 and 4,096 tokens, one new token on each side (engine ``generate`` with
  ``max_tokens=1`` vs HF ``generate`` with ``max_new_tokens=1``); tok/s = prompt tokens / seconds. The engine
  runs twice: with its default per-step token budget (``max_num_batched_tokens``, 2,048 as vLLM's CPU server
  default, so a longer prompt is prefilled in chunks, each attending to the KV of the chunks before it) and
  with a budget as large as the prompt (one step, as HF does).
- Decode: batch 1 and 16; decode is isolated from prefill by timing each run with ``n`` and with 1 new token
  and dividing the extra tokens by the extra time.

The engine runs without its prefix cache: every figure repeats the same prompts, so with the cache (on by
default) each run after the first would prefill from cached rBlocks, which HF cannot.

Run: ``.venv/bin/python benchmarks/engine_throughput.py`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.models.registry import load_model_files, resolve_model

PROMPT_WORDS = "Summarise the plot of a novel about a lighthouse keeper who finds a message in a bottle. "
DEFAULT_BUDGET = EngineConfig().max_num_batched_tokens

RunFn = Callable[[list[list[int]], int], float]  # (prompts, new tokens) -> seconds


def prompts(tokenizer, batch: int) -> list[list[int]]:  # noqa: ANN001
    base = tokenizer.encode(PROMPT_WORDS * 3)
    return [base[i % 7 :] for i in range(batch)]  # slightly different lengths, as real traffic


def long_prompt(tokenizer, num_tokens: int) -> list[int]:  # noqa: ANN001
    """``num_tokens`` ids of prose (the prompt text numbered and repeated, so it is not one loop)."""
    text = " ".join(f"Chapter {i}. {PROMPT_WORDS}" for i in range(num_tokens // 8))
    ids = tokenizer.encode(text)
    assert len(ids) >= num_tokens, "the text is too short for the prompt length"
    return ids[:num_tokens]


def engine_seconds(engine: LLMEngine, ids: list[list[int]], n: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(ids, params)
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t


def hf_seconds(model, tokenizer, ids: list[list[int]], n: int) -> float:  # noqa: ANN001
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


STAT: Callable[[list[float]], float] = min  # best of the repeats; --stat median sets statistics.median


def best_seconds(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """``STAT`` (best or median) time of each run over ``repeats`` rounds; the runs interleave so load hits
    them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return {name: STAT(t) for name, t in times.items()}


def decode_step_seconds(run: RunFn, ids: list[list[int]], n: int, repeats: int = 1) -> float:
    """Seconds of one decode step: ``run(ids, n)`` minus ``run(ids, 1)`` (the prefill), over ``n - 1`` steps."""
    run(ids, 2)  # warm-up
    best = best_seconds({"full": lambda: run(ids, n), "one": lambda: run(ids, 1)}, repeats)
    return max(best["full"] - best["one"], 1e-9) / (n - 1)


def decode_rate(run: RunFn, ids: list[list[int]], n: int, repeats: int = 1) -> float:
    return len(ids) / decode_step_seconds(run, ids, n, repeats)


def prefill_table(engines: dict[int, LLMEngine], hf, tokenizer, lengths: list[int], repeats: int) -> None:  # noqa: ANN001
    """Print prompt tok/s of the engine with its default budget, with one step per prompt, and of HF."""
    print(
        f"\nprefill (1 prompt, 1 new token); engine 'chunked' = default max_num_batched_tokens {DEFAULT_BUDGET}, "
        "'one step' = budget >= prompt"
    )
    print(f"{'prompt':>6s} {'chunked':>9s} {'one step':>9s} {'HF tok/s':>9s} {'chunked/HF':>11s} {'one step/HF':>12s}")
    for n in lengths:
        ids = [long_prompt(tokenizer, n)]
        runs = {
            "chunked": functools.partial(engine_seconds, engines[DEFAULT_BUDGET], ids, 1),
            "one step": functools.partial(engine_seconds, engines[max(lengths)], ids, 1),
            "hf": functools.partial(hf_seconds, hf, tokenizer, ids, 1),
        }
        best_seconds(runs, 1)  # warm-up: first-touch allocations of this size
        rate = {k: n / s for k, s in best_seconds(runs, repeats).items()}
        print(
            f"{n:6d} {rate['chunked']:9.1f} {rate['one step']:9.1f} {rate['hf']:9.1f} "
            f"{rate['chunked'] / rate['hf']:11.2f} {rate['one step'] / rate['hf']:12.2f}",
            flush=True,
        )


def decode_table(engine: LLMEngine, hf, tokenizer, batches: list[int], n: int, repeats: int) -> None:  # noqa: ANN001
    print(f"\ndecode ({n} new tokens, engine defaults)")
    print(f"{'batch':>5s} {'engine tok/s':>13s} {'HF tok/s':>10s} {'engine/HF':>10s}")
    for batch in batches:
        ids = prompts(tokenizer, batch)
        ours = decode_rate(lambda i, k: engine_seconds(engine, i, k), ids, n, repeats)
        theirs = decode_rate(lambda i, k: hf_seconds(hf, tokenizer, i, k), ids, n, repeats)
        print(f"{batch:5d} {ours:13.1f} {theirs:10.1f} {ours / theirs:10.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-lengths", type=int, nargs="*", default=[512, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per figure")
    ap.add_argument("--stat", choices=["best", "median"], default="best", help="figure kept of the timed runs")
    ap.add_argument("--partitions", type=int, default=1, help="DistAttention partitions of the engine")
    a = ap.parse_args()
    global STAT
    STAT = min if a.stat == "best" else statistics.median
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(None)
    cfg, state_dict, tokenizer = load_model_files(resolved, torch.float32)
    budgets = {DEFAULT_BUDGET, max(a.prompt_lengths, default=DEFAULT_BUDGET)}
    engines = {
        b: LLMEngine.from_weights(
            cfg,
            state_dict,
            tokenizer,
            EngineConfig(num_partitions=a.partitions, max_num_batched_tokens=b, enable_prefix_caching=False),
        )
        for b in budgets
    }
    hf = AutoModelForCausalLM.from_pretrained(
        str(resolved.path.parent), gguf_file=resolved.path.name, dtype=torch.float32
    ).eval()
    print(
        f"model {resolved.name}, fp32, CPU threads {torch.get_num_threads()}, engine partitions {a.partitions}, "
        f"HF attention {hf.config._attn_implementation}, {a.stat} of {a.repeats}"
    )
    if a.prompt_lengths:
        prefill_table(engines, hf, tokenizer, a.prompt_lengths, a.repeats)
    decode_table(engines[DEFAULT_BUDGET], hf, tokenizer, a.batches, a.new_tokens, a.repeats)


if __name__ == "__main__":
    main()
