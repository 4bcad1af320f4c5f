"""CPU decode with SwiGLU's gate and up as one matmul or two (``core/model.py`` ``MLP``), interleaved in one run.

The engine on CPU splits the fused ``gate_up_proj`` weight into its two halves for steps of
``MLP.CPU_SPLIT_TOKENS`` tokens. This prints decode ms per step of two engines stepping the same batch, one
splitting at every batch size and one never (one matmul), alternating rounds so both see the same machine
load, and their median ratio per batch size. SmolLM2-135M-Instruct fp32.
Run: ``PYTHONPATH=. .venv/bin/python benchmarks/gate_up_split.py [--batches 1 16 --rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_throughput import prompts  # the same prompts as the engine-vs-HF table

from infinite_llm.core.model import MLP
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.models.registry import load_model_files, resolve_model


def decoding_engine(cfg, state_dict, tokenizer, batch: int, steps: int) -> LLMEngine:  # noqa: ANN001
    """An engine with ``batch`` requests past their prefill, with room for ``steps`` more decode steps."""
    engine = LLMEngine.from_weights(cfg, state_dict, tokenizer, EngineConfig(enable_prefix_caching=False))
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for ids in prompts(tokenizer, batch):
        engine.add_request(ids, params)
    for _ in range(4):  # prefill, then warm decode steps
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    a = ap.parse_args()
    cfg, state_dict, tokenizer = load_model_files(resolve_model(None), torch.float32)
    default = MLP.CPU_SPLIT_TOKENS
    print(f"model SmolLM2-135M-Instruct fp32, CPU threads {torch.get_num_threads()}, {a.rounds} interleaved rounds")
    print(f"{'batch':>5} {'two ms/step':>12} {'one ms/step':>12} {'one/two':>8}")
    for batch in a.batches:
        engines = {k: decoding_engine(cfg, state_dict, tokenizer, batch, a.rounds * a.steps) for k in ("two", "one")}
        times: dict[str, list[float]] = {"two": [], "one": []}
        try:
            for _ in range(a.rounds):
                for key, engine in engines.items():
                    MLP.CPU_SPLIT_TOKENS = (1, 1 << 30) if key == "two" else (1, 0)
                    start = time.perf_counter()
                    for _ in range(a.steps):
                        engine.step()
                    times[key].append(1e3 * (time.perf_counter() - start) / a.steps)
        finally:
            MLP.CPU_SPLIT_TOKENS = default
        two, one = statistics.median(times["two"]), statistics.median(times["one"])
        print(f"{batch:5d} {two:12.1f} {one:12.1f} {one / two:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
