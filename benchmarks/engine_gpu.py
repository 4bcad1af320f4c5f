"""The engine vs HF transformers ``generate`` on one GPU, side by side, on a Llama-3.2-1B-shaped model.

The model is built from a config with seeded random weights (no download): 16 layers, hidden 2048,
intermediate 8192, 32 query / 8 kv heads of 64, vocab 49152, Llama-3 RoPE scaling. HF's
``LlamaForCausalLM`` (``attn_implementation="sdpa"``) and our ``LLMEngine`` (same weights, via
``LLMEngine.from_weights``) run the same token-id prompts, greedy, one after the other. It prints:

1. fp32 greedy equality with HF (4 prompts, 24 new tokens), the engine (CUDA-graph decode) with 1 and 3
   partitions;
2. bf16 decode tok/s at batch 1, 16, 64 (prompt 512, 128 new tokens): the engine with CUDA-graph decode
   (the default), the engine with ``enforce_eager``, HF, and the ratios;
3. one 32K-token prompt: time to first token and decode tok/s;
4. a batch-1 decode step of both engines: wall time, GPU-busy fraction (torch.profiler kernel time / wall
   time), kernels launched per step, and the weight-read floor (bf16 weights / 4.3 TB/s).

Decode tok/s counts tokens produced after every sequence of the batch has its first token, over the time
from then to the last token (HF: timestamps taken by a logits processor at each step), so prefill is
excluded on both sides. Exits 0 without a GPU, unless ``--device cpu`` (``--tiny``: a smoke test of
the code path with a 2-layer model, seconds on a CPU). Needs torch, transformers, triton; ~2-3 min on
an H200, ``--quick`` less.

    python benchmarks/engine_gpu.py [--quick] [--device cpu --tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass, replace

import torch
from gpu_timing import device_time, sync

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.models.hf import config_from_hf_dict

# Untied embeddings (Llama-3.2-1B ties them): with random weights a tied LM head mostly predicts the input
# token again, which would make the equality check trivial.
LLAMA_3_2_1B = dict(
    vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)  # fmt: skip
TINY = dict(LLAMA_3_2_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rope_scaling=dict(LLAMA_3_2_1B["rope_scaling"], original_max_position_embeddings=64))  # fmt: skip


@dataclass(frozen=True)
class Workload:
    model: dict
    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 512
    new_tokens: int = 128
    long_prompt: int = 32768
    long_new_tokens: int = 32
    eq_prompt_lens: tuple[int, ...] = (37, 100, 16, 250)  # across block boundaries
    eq_new_tokens: int = 24
    token_budget: int = 8192  # engine max_num_batched_tokens: prefill chunk size
    profile_steps: int = 10
    block_size: int = 16

    @property
    def kv_blocks(self) -> int:
        """rBlocks for the largest decode batch or the long prompt, whichever needs more, plus slack."""
        per_seq = -(-(self.prompt_len + self.new_tokens) // self.block_size)
        long = -(-(self.long_prompt + self.long_new_tokens) // self.block_size)
        return max(max(self.batches) * per_seq, long) + 64


PEAK_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, measured (benchmarks/kernels_gpu.py)
FULL = Workload(LLAMA_3_2_1B)
QUICK = replace(FULL, batches=(1, 16), new_tokens=64, long_prompt=16384, long_new_tokens=16)
SMOKE = Workload(TINY, batches=(1, 4), prompt_len=24, new_tokens=6, long_prompt=200, long_new_tokens=4,
                 eq_prompt_lens=(5, 17, 3, 40), eq_new_tokens=8, token_budget=64, profile_steps=2,
                 block_size=4)  # fmt: skip


class TokenIdTokenizer:
    """What the engine needs of a tokenizer, for token-id prompts and no text (random weights have none)."""

    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise TypeError("this benchmark passes token ids, not text")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def detokenizer(self, prompt_ids: list[int] = ()) -> _NoText:  # noqa: B006 - never mutated
        return _NoText()


class _NoText:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass(frozen=True)
class Run:
    """One generation: time to the first token of the batch's last sequence, decode rate after it."""

    ttft_s: float
    decode_tok_s: float
    token_ids: list[list[int]]


def build_hf(work: Workload, device: str):
    """HF ``LlamaForCausalLM`` with seeded random weights, fp32, eval, on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**work.model, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def build_engine(
    hf, work: Workload, dtype: torch.dtype, device: str, num_partitions: int = 1, enforce_eager: bool = False
) -> LLMEngine:
    """Our engine with ``hf``'s weights (HF names), KV for the whole workload; CUDA-graph decode on CUDA
    unless ``enforce_eager`` (on CPU: its static buffers, uncaptured, so the smoke test covers them)."""
    model_config = config_from_hf_dict(hf.config.to_dict())
    config = EngineConfig(
        block_size=work.block_size, num_kv_blocks=work.kv_blocks, num_partitions=num_partitions,
        max_num_seqs=max(work.batches), max_num_batched_tokens=work.token_budget, dtype=dtype, device=device,
        enforce_eager=enforce_eager, static_decode_without_graphs=not enforce_eager and device == "cpu",
        enable_prefix_caching=False,  # warm-up and timed runs repeat their prompts; HF prefills them in full
    )  # fmt: skip
    state_dict = {name: t.detach() for name, t in hf.state_dict().items()}
    return LLMEngine.from_weights(model_config, state_dict, TokenIdTokenizer(), config)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> Run:
    """Generate ``new_tokens`` per prompt, all queued at once; time each step (sampling syncs the GPU)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    all_first, counted = None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        sync()
        now = time.perf_counter()
        for o in outputs:
            if all_first is not None:
                counted += len(o.new_token_ids)
            first.setdefault(o.request_id, now)
            tokens[o.request_id] += o.new_token_ids
        if all_first is None and len(first) == len(ids):
            all_first = now
    end = time.perf_counter()
    return Run(max(first.values()) - start, counted / max(end - all_first, 1e-9), [tokens[i] for i in ids])


class StepClock:
    """A logits processor that only records when each step's logits exist (after a GPU sync)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync()
        self.times.append(time.perf_counter())
        return scores


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> Run:
    """HF greedy ``generate`` of equal-length prompts in one batch (no padding), timed by :class:`StepClock`."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, device=device)
    clock = StepClock()
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]),
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    sync()
    decode_s = clock.times[-1] - clock.times[0]
    rate = len(prompts) * (len(clock.times) - 1) / max(decode_s, 1e-9)
    return Run(clock.times[0] - start, rate, out[:, input_ids.shape[1] :].tolist())


def check_equality(hf, work: Workload, device: str) -> bool:
    """fp32 greedy tokens of the engine (1 and 3 partitions, one batch) vs HF (one prompt at a time)."""
    prompts = [random_prompts(1, n, work.model["vocab_size"], seed=10 + n)[0] for n in work.eq_prompt_lens]
    want = [run_hf(hf, [p], work.eq_new_tokens).token_ids[0] for p in prompts]
    distinct = sorted(len(set(w)) for w in want)
    print(f"fp32 greedy vs HF, {len(prompts)} prompts x {work.eq_new_tokens} tokens (distinct per prompt: {distinct})")
    ok = True
    for parts in (1, 3):
        engine = build_engine(hf, work, torch.float32, device, num_partitions=parts)
        got = run_engine(engine, prompts, work.eq_new_tokens).token_ids
        same = [g == w for g, w in zip(got, want, strict=True)]
        ok &= all(same)
        detail = "; ".join(f"prompt {i} diverges at token {_divergence(g, w)}" for i, (g, w, s) in
                           enumerate(zip(got, want, same, strict=True)) if not s)  # fmt: skip
        print(f"  engine, {parts} partition(s): {sum(same)}/{len(same)} prompts equal {detail}")
        del engine
    return ok


def _divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_decode(hf, engine: LLMEngine, eager: LLMEngine, work: Workload) -> None:
    """bf16 decode tok/s, engine (CUDA graphs) vs engine (eager) vs HF, per batch size (after a warm-up)."""
    print(f"bf16 decode tok/s, prompt {work.prompt_len}, {work.new_tokens} new tokens")
    for batch in work.batches:
        prompts = random_prompts(batch, work.prompt_len, work.model["vocab_size"], seed=batch)
        for warm in (engine, eager):
            run_engine(warm, prompts, 4)  # warm-up: compiles this shape's kernels
        run_hf(hf, prompts, 4)
        ours, slow = run_engine(engine, prompts, work.new_tokens), run_engine(eager, prompts, work.new_tokens)
        theirs = run_hf(hf, prompts, work.new_tokens)
        same = sum(a == b for a, b in zip(ours.token_ids, slow.token_ids, strict=True))
        print(f"  batch {batch:3d}: engine {ours.decode_tok_s:9.1f}  eager {slow.decode_tok_s:9.1f}  "
              f"HF {theirs.decode_tok_s:9.1f}  engine/HF {ours.decode_tok_s / theirs.decode_tok_s:5.2f}  "
              f"engine/eager {ours.decode_tok_s / slow.decode_tok_s:5.2f}  "
              f"({same}/{batch} sequences with the eager tokens)")  # fmt: skip
    print(
        "  (bf16: graphs size the KV splits for a bucket's full block-table width, eager for the step's, so\n"
        "   rounding differs and random-weight greedy paths may part; fp32 equality with HF is checked above)"
    )


def compare_long_prompt(hf, engine: LLMEngine, eager: LLMEngine, work: Workload) -> None:
    """One long prompt: time to first token and decode tok/s at that context, engine vs HF."""
    warm = random_prompts(1, work.token_budget + 16, work.model["vocab_size"], seed=3)  # 2 chunks
    run_engine(engine, warm, 2)
    run_hf(hf, warm, 2)
    prompt = random_prompts(1, work.long_prompt, work.model["vocab_size"], seed=1)
    ours, theirs = run_engine(engine, prompt, work.long_new_tokens), run_hf(hf, prompt, work.long_new_tokens)
    print(f"bf16 {work.long_prompt}-token prompt, {work.long_new_tokens} new tokens "
          f"(engine prefill chunks of {work.token_budget} tokens)")  # fmt: skip
    print(f"  TTFT    : engine {ours.ttft_s:7.3f} s  HF {theirs.ttft_s:7.3f} s  "
          f"engine/HF {ours.ttft_s / theirs.ttft_s:5.2f}")  # fmt: skip
    print(f"  decode  : engine {ours.decode_tok_s:7.1f} tok/s  HF {theirs.decode_tok_s:7.1f} tok/s  "
          f"engine/HF {ours.decode_tok_s / theirs.decode_tok_s:5.2f}")  # fmt: skip


def profile_decode_steps(hf, engine: LLMEngine, eager: LLMEngine, work: Workload) -> None:
    """:func:`profile_decode_step` of both engines, beside the weight-read floor of the model."""
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    floor_ms = weight_bytes / PEAK_BYTES_PER_S * 1e3
    print(f"weight-read floor: {weight_bytes / 1e9:.2f} GB / 4.3 TB/s = {floor_ms:.3f} ms per step "
          f"({1e3 / floor_ms:.0f} tok/s at batch 1)")  # fmt: skip
    for name, e in (("CUDA graphs", engine), ("eager", eager)):
        profile_decode_step(e, work, name)


def profile_decode_step(engine: LLMEngine, work: Workload, name: str = "engine") -> None:
    """Wall time, GPU-busy fraction and kernel count of one batch-1 decode step at a ``prompt_len`` context."""
    prompt = random_prompts(1, work.prompt_len, work.model["vocab_size"], seed=2)[0]
    steps = 8 * work.profile_steps + 4
    rid = engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    while not any(o.request_id == rid for o in engine.step()):  # prefill until the first token
        pass
    sync()
    start = time.perf_counter()
    for _ in range(work.profile_steps):
        engine.step()
    sync()
    wall_us = (time.perf_counter() - start) / work.profile_steps * 1e6
    gpu = device_time(engine.step, work.profile_steps)
    host = host_profile(engine.step, 5 * work.profile_steps) if name == "CUDA graphs" else None
    engine.abort(rid)
    busy = f"{gpu.busy_us / wall_us:5.2f}" if torch.cuda.is_available() else "n/a (no CUDA)"
    if name == "CUDA graphs":  # where the GPU time of a step goes: the next thing to cut
        print("  GPU time per step by kernel (us, launches):")
        for kernel, us, launches in gpu.by_name[:12]:
            print(f"    {us:8.1f} us {launches:5.0f}x  {kernel[:100]}")
    if host:
        print(host)
    print(f"{name:>11s} batch-1 decode step at {work.prompt_len} tokens: wall {wall_us / 1e3:7.3f} ms "
          f"({1e6 / wall_us:6.0f} tok/s), GPU busy {gpu.busy_us / 1e3:7.3f} ms, busy fraction {busy}, "
          f"{gpu.kernels:.0f} kernels per step")  # fmt: skip


def host_profile(fn, iters: int, top: int = 18) -> str:  # noqa: ANN001
    """Where the host's time of ``iters`` calls of ``fn`` goes (cProfile, own time, slowest first): the part
    of a graph-replayed step the GPU waits for."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        fn()
    sync()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    head = f"  host time of {iters} steps under cProfile (own time, slowest first):"
    return "\n".join([head] + ["    " + line for line in lines[-top - 1 :]])


def device_parser(doc: str) -> argparse.ArgumentParser:
    """The GPU benchmarks' parser: ``--device cuda|cpu`` and ``--tiny`` (the CPU smoke workload)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="2-layer model, a few tokens: a smoke test")
    return parser


def parse_device_args(parser: argparse.ArgumentParser, script: str) -> argparse.Namespace | None:
    """Parsed arguments; ``--device cpu`` without ``--tiny`` exits 2 (the 1B-shaped workload would run for
    hours on a CPU); ``None`` after one line when CUDA is asked for and this machine has none."""
    args = parser.parse_args()
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu runs only the --tiny smoke workload")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (or --device cpu --tiny); none found, nothing to measure.")
        return None
    return args


def main() -> int:
    parser = device_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 16, 64 new tokens, 16K prompt")
    parser.add_argument("--skip-equality", action="store_true", help="skip the fp32 equality check")
    args = parse_device_args(parser, "engine_gpu.py")
    if args is None:
        return 0
    work = SMOKE if args.tiny else QUICK if args.quick else FULL
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 equality needs full-precision matmuls
    hf = build_hf(work, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}: {work.model['num_hidden_layers']} layers, hidden {work.model['hidden_size']}, "
          f"{work.model['num_attention_heads']}/{work.model['num_key_value_heads']} heads x {work.model['head_dim']}, "
          f"vocab {work.model['vocab_size']}, random weights")  # fmt: skip
    ok = True if args.skip_equality else section(check_equality, hf, work, args.device)
    hf = hf.to(torch.bfloat16)
    engine = build_engine(hf, work, torch.bfloat16, args.device)
    eager = build_engine(hf, work, torch.bfloat16, args.device, enforce_eager=True)
    timed = [section(fn, hf, engine, eager, work) for fn in (compare_decode, compare_long_prompt, profile_decode_steps)]
    print("equality: " + ("ok" if ok else "MISMATCH") + ("" if all(timed) else "; a section FAILED (above)"))
    return 0 if ok and all(timed) else 1


def section(fn, *args) -> bool:  # noqa: ANN001
    """Run one section; an exception is printed and the next section still runs (GPU time is scarce)."""
    try:
        return fn(*args) is not False
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print(f"{fn.__name__}: FAILED")
        return False


if __name__ == "__main__":
    sys.exit(main())
