"""Triton kernels vs their torch references on realistic shapes (needs CUDA; exits 0 without it).

Checks ``infinite_llm.kernels`` paged partial attention and merge against ``infinite_llm.core.attention`` on
Llama-3-8B-like attention (32 query heads, 8 kv heads, head_dim 128, block_size 16, bf16): decode at 4k-32k
tokens of context for batch 1 and 16, and a 512-token causal prefill chunk over 32k tokens. Per case it
prints the call's wall time (host included: checks, one host sync, launches), the GPU time (torch.profiler:
kernel durations only), the KV bytes read per second of GPU time (K and V of every context token once, the
decode roofline) and that figure as a fraction of the H200's 4.3 TB/s copy bandwidth; for the prefill chunk
also TFLOP/s. A sweep then times forced tile sizes and split counts on the 32k cases, the policy's pick
(``infinite_llm/kernels/launch_plan.py``) and the previous one among them, to tune the policy. Decode calls
pass ``max_query_len=1`` as the engine's CUDA graphs do (no host sync, no extra kernel).

    python benchmarks/kernels_gpu.py [--iters 20] [--quick] [--no-sweep]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from gpu_timing import H200_BF16_TFLOPS, H200_COPY_TBPS, device_time, wall_ms

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

    @property
    def kv_bytes(self) -> int:
        """K and V of every context token of every sequence, once."""
        return 2 * self.batch * self.context_len * NUM_KV_HEADS * HEAD_DIM * self.dtype.itemsize

    @property
    def flops(self) -> float:
        """QK^T and PV of every query over its visible (causal) keys."""
        visible = sum(self.context_len - self.chunk + 1 + i for i in range(self.chunk))
        return 4.0 * self.batch * visible * NUM_HEADS * HEAD_DIM


DECODE_32K_B1 = Case("decode b=1 ctx=32k", 1, 32768, 1)
DECODE_32K_B16 = Case("decode b=16 ctx=32k", 16, 32768, 1)
PREFILL_32K = Case("prefill chunk 512 b=1 ctx=32k", 1, 32768, 512)
CASES = [
    *(Case(f"decode b={b} ctx={c // 1024}k", b, c, 1) for b in (1, 16) for c in (4096, 16384)),
    DECODE_32K_B1,
    DECODE_32K_B16,
    PREFILL_32K,
    Case("decode b=16 ctx=4k fp32", 16, 4096, 1, torch.float32),
]
QUICK_CASES = [DECODE_32K_B1, DECODE_32K_B16, PREFILL_32K]


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


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    return float((got.float() - want.float())[finite].abs().max()) if finite.any() else 0.0


def rates(case: Case, gpu_us: float) -> str:
    """KV read rate of GPU time, its fraction of the copy roofline, and TFLOP/s for prefill chunks."""
    tbps = case.kv_bytes / gpu_us / 1e6
    text = f"KV {tbps:5.2f} TB/s = {tbps / H200_COPY_TBPS:4.2f} of {H200_COPY_TBPS}"
    if case.chunk > 1:
        tflops = case.flops / gpu_us / 1e6
        text += f"  {tflops:6.1f} TFLOP/s = {tflops / H200_BF16_TFLOPS:4.2f} of {H200_BF16_TFLOPS:.0f}"
    return text


def run_case(case: Case, iters: int, gen: torch.Generator, device: torch.device) -> bool:
    """Check one case against the reference and print one row; returns whether it was within tolerance."""
    from infinite_llm.kernels.paged_attention import triton_partial_attention

    query, k_cache, v_cache, meta = make_inputs(case, device, gen)
    hint = dict(max_query_len=1) if case.chunk == 1 else {}  # decode: as the engine's graphs call it
    out, lse = triton_partial_attention(query, k_cache, v_cache, meta, **hint)
    ref_out, ref_lse = partial_attention(query, k_cache, v_cache, meta)
    out_err, lse_err = max_error(out, ref_out), max_error(lse, ref_lse)
    out_tol, lse_tol = TOLERANCE[case.dtype]
    ok = out_err <= out_tol and lse_err <= lse_tol
    call = lambda: triton_partial_attention(query, k_cache, v_cache, meta, **hint)  # noqa: E731
    triton_ms = wall_ms(call, iters)
    gpu = device_time(call, iters)
    torch_ms = wall_ms(lambda: partial_attention(query, k_cache, v_cache, meta), max(3, iters // 4))
    print(
        f"{case.name:<30} call {triton_ms:7.3f} ms  GPU {gpu.busy_us / 1e3:7.3f} ms ({gpu.kernels:.0f} kernels)  "
        f"torch {torch_ms:8.3f} ms x{torch_ms / triton_ms:5.1f}  {rates(case, gpu.busy_us)}  "
        f"err out {out_err:.1e} lse {lse_err:.1e}  {'ok' if ok else 'MISMATCH'}"
    )
    return ok


def sweep_configs(case: Case) -> list[tuple[str, dict]]:
    """Forced launches to time on ``case``: the previous policy, the policy's neighbours, and a few outliers."""
    from infinite_llm.kernels.launch_plan import TileOverrides as T

    if case.chunk > 1:  # previous: 4 programs per SM (5 splits here)
        return [
            ("previous m128 n64 w8 s5", dict(num_splits=5, tiles=T(block_m=128, block_n=64, num_warps=8))),
            ("m64 n64 w4", dict(tiles=T(block_m=64, block_n=64, num_warps=4))),
            ("m128 n64 w8 split 1", dict(num_splits=1, tiles=T(block_m=128, block_n=64, num_warps=8))),
            ("m128 n64 w8 stages 2", dict(tiles=T(block_m=128, block_n=64, num_warps=8, num_stages=2))),
            ("policy", dict()),
        ]
    # previous policy: 64-key tiles, 4 programs per SM (batch 1: 64 splits; batch 16: 5)
    previous = 64 if case.batch == 1 else 5
    splits = (16, 22, 44, 66) if case.batch == 1 else (2, 4, 5)
    configs = [(f"previous n64 s{previous}", dict(num_splits=previous, tiles=T(block_n=64)))]
    configs += [("n64 (policy splits)", dict(tiles=T(block_n=64)))]
    configs += [("n64 splits 3", dict(num_splits=3, tiles=T(block_n=64)))] if case.batch > 1 else []
    configs += [(f"n128 splits {s}", dict(num_splits=s, tiles=T(block_n=128))) for s in splits]
    configs += [
        ("n128 w8 (policy splits)", dict(tiles=T(block_n=128, num_warps=8))),
        ("n128 stages 2 (policy splits)", dict(tiles=T(block_n=128, num_stages=2))),
        ("n128 stages 4 (policy splits)", dict(tiles=T(block_n=128, num_stages=4))),
        ("policy", dict()),
    ]
    return configs


def run_sweep(case: Case, iters: int, gen: torch.Generator, device: torch.device) -> None:
    """GPU time of each forced launch shape on ``case``; a shape that fails to compile is reported, not fatal."""
    from infinite_llm.kernels.paged_attention import triton_partial_attention

    query, k_cache, v_cache, meta = make_inputs(case, device, gen)
    ref_out, _ = triton_partial_attention(query, k_cache, v_cache, meta, num_splits=1)
    hint = dict(max_query_len=1) if case.chunk == 1 else {}  # decode: as the engine's graphs call it
    print(f"-- sweep: {case.name}")
    for label, kwargs in sweep_configs(case):
        call = lambda kw=kwargs: triton_partial_attention(query, k_cache, v_cache, meta, **kw, **hint)  # noqa: E731
        try:
            err = max_error(call()[0], ref_out)
            gpu = device_time(call, iters)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for one shape
            print(f"   {label:<30} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        parts = " + ".join(f"{us:.1f}" for _, us, _ in gpu.by_name[:3])  # attention kernel, then the merge
        print(f"   {label:<30} GPU {gpu.busy_us:8.1f} us ({parts})  {rates(case, gpu.busy_us)}  "
              f"err vs 1 split {err:.1e}")  # fmt: skip


def run_merge(iters: int, gen: torch.Generator, device: torch.device) -> bool:
    """Merge of 8 holders' fp32 partials for a decode batch of 16, against ``core.merge_partials``."""
    from infinite_llm.kernels.merge import triton_merge_partials

    outs = torch.randn(8, 16, NUM_HEADS, HEAD_DIM, generator=gen, device=device)
    lses = torch.randn(8, 16, NUM_HEADS, generator=gen, device=device) * 4
    lses[3] = -math.inf  # one holder had nothing for these sequences
    out, lse = triton_merge_partials(outs, lses)
    ref_out, ref_lse = merge_partials(outs, lses)
    err = max(max_error(out, ref_out), max_error(lse, ref_lse))
    triton_ms = wall_ms(lambda: triton_merge_partials(outs, lses), iters)
    torch_ms = wall_ms(lambda: merge_partials(outs, lses), iters)
    ok = err <= 1e-5
    print(f"{'merge 8 parts b=16':<30} call {triton_ms:7.3f} ms  torch {torch_ms:8.3f} ms  "
          f"x{torch_ms / triton_ms:5.1f}  err {err:.1e}  {'ok' if ok else 'MISMATCH'}")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case")
    parser.add_argument("--quick", action="store_true", help="only the three 32k cases, 10 calls, no sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile/split sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA GPU (Triton kernels); none found, nothing to measure.")
        return 0
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    iters = 10 if args.quick else args.iters
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name} ({props.multi_processor_count} SMs): {NUM_HEADS} heads, {NUM_KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; roofline {H200_COPY_TBPS} TB/s")  # fmt: skip
    results = [run_case(case, iters, gen, device) for case in (QUICK_CASES if args.quick else CASES)]
    results.append(run_merge(iters, gen, device))
    if not (args.quick or args.no_sweep):
        for case in (DECODE_32K_B1, DECODE_32K_B16, PREFILL_32K):
            run_sweep(case, iters, gen, device)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
