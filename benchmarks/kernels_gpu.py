"""Triton kernels vs their torch references on realistic shapes (needs CUDA; exits 0 without it).

Checks ``infinite_llm.kernels`` paged partial attention and merge against ``infinite_llm.core.attention`` on
Llama-3-8B-like attention (32 heads, 8 kv heads, head_dim 128, block_size 16, bf16), decode at 4k-32k tokens
of context for batch 1 and 16 plus a causal prefill chunk, then prints time per call of both and the KV bytes
read per second by the kernel (K and V of every context token once per step, the decode roofline).

    .venv/bin/python benchmarks/kernels_gpu.py [--iters 20]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinite_llm.core.attention import PartialAttentionMetadata, merge_partials, partial_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# (out, lse) tolerance. bf16: the kernel feeds bf16 probabilities to the 2nd matmul, as FlashAttention does.
TOLERANCE = {torch.bfloat16: (3e-2, 1e-2), torch.float32: (1e-4, 1e-4)}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context_len: int
    chunk: int  # query tokens per sequence, ending at the last position (1 = decode)
    dtype: torch.dtype = torch.bfloat16


CASES = [
    *(Case(f"decode b={b} ctx={c // 1024}k", b, c, 1) for b in (1, 16) for c in (4096, 16384, 32768)),
    Case("prefill chunk 512 b=1 ctx=32k", 1, 32768, 512),
    Case("decode b=16 ctx=4k fp32", 16, 4096, 1, torch.float32),
]


def make_inputs(case: Case, device: torch.device, gen: torch.Generator):
    """Query, a K/V pool holding every block of every sequence at shuffled physical ids, and metadata."""
    blocks = math.ceil(case.context_len / BLOCK_SIZE)
    pool_shape = (case.batch * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(pool_shape, generator=gen, device=device).to(case.dtype)
    v_cache = torch.randn(pool_shape, generator=gen, device=device).to(case.dtype)
    physical = torch.randperm(case.batch * blocks, generator=gen, device=device).view(case.batch, blocks)
    positions = torch.arange(case.context_len - case.chunk, case.context_len, device=device)
    meta = PartialAttentionMetadata(
        query_start_loc=torch.arange(case.batch + 1, device=device) * case.chunk,
        query_positions=positions.repeat(case.batch),
        block_ids=physical,
        block_indices=torch.arange(blocks, device=device).expand(case.batch, blocks).contiguous(),
        num_blocks=torch.full((case.batch,), blocks, device=device),
        context_lens=torch.full((case.batch,), case.context_len, device=device),
    )
    query_shape = (case.batch * case.chunk, NUM_HEADS, HEAD_DIM)
    query = torch.randn(query_shape, generator=gen, device=device).to(case.dtype)
    return query, k_cache, v_cache, meta


def time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean wall time of ``fn`` in milliseconds after 3 warm-up calls (the first compiles the kernel)."""
    for _ in range(3):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    return float((got.float() - want.float())[finite].abs().max()) if finite.any() else 0.0


def run_case(case: Case, iters: int, gen: torch.Generator, device: torch.device) -> bool:
    """Check one case against the reference and print one row; returns whether it was within tolerance."""
    from infinite_llm.kernels.paged_attention import triton_partial_attention

    query, k_cache, v_cache, meta = make_inputs(case, device, gen)
    out, lse = triton_partial_attention(query, k_cache, v_cache, meta)
    ref_out, ref_lse = partial_attention(query, k_cache, v_cache, meta)
    out_err, lse_err = max_error(out, ref_out), max_error(lse, ref_lse)
    out_tol, lse_tol = TOLERANCE[case.dtype]
    ok = out_err <= out_tol and lse_err <= lse_tol
    triton_ms = time_ms(lambda: triton_partial_attention(query, k_cache, v_cache, meta), iters, device)
    torch_ms = time_ms(lambda: partial_attention(query, k_cache, v_cache, meta), max(3, iters // 4), device)
    kv_bytes = 2 * case.batch * case.context_len * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    print(
        f"{case.name:<32} triton {triton_ms:8.3f} ms  torch {torch_ms:9.3f} ms  "
        f"x{torch_ms / triton_ms:6.1f}  KV read {kv_bytes / triton_ms / 1e6:7.1f} GB/s  "
        f"err out {out_err:.1e} lse {lse_err:.1e}  {'ok' if ok else 'MISMATCH'}"
    )
    return ok


def run_merge(iters: int, gen: torch.Generator, device: torch.device) -> bool:
    """Merge of 8 holders' fp32 partials for a decode batch of 16, against ``core.merge_partials``."""
    from infinite_llm.kernels.merge import triton_merge_partials

    outs = torch.randn(8, 16, NUM_HEADS, HEAD_DIM, generator=gen, device=device)
    lses = torch.randn(8, 16, NUM_HEADS, generator=gen, device=device) * 4
    lses[3] = -math.inf  # one holder had nothing for these sequences
    out, lse = triton_merge_partials(outs, lses)
    ref_out, ref_lse = merge_partials(outs, lses)
    err = max(max_error(out, ref_out), max_error(lse, ref_lse))
    triton_ms = time_ms(lambda: triton_merge_partials(outs, lses), iters, device)
    torch_ms = time_ms(lambda: merge_partials(outs, lses), iters, device)
    ok = err <= 1e-5
    print(f"{'merge 8 parts b=16':<32} triton {triton_ms:8.3f} ms  torch {torch_ms:9.3f} ms  "
          f"x{torch_ms / triton_ms:6.1f}  err {err:.1e}  {'ok' if ok else 'MISMATCH'}")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA GPU (Triton kernels); none found, nothing to measure.")
        return 0
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: {NUM_HEADS} heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
          f"block_size {BLOCK_SIZE}")  # fmt: skip
    results = [run_case(case, args.iters, gen, device) for case in CASES]
    results.append(run_merge(args.iters, gen, device))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
