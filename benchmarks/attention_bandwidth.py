"""KV bytes read per second by the paged partial attention (torch path), beside the machine's memcpy bandwidth.

Decode attention is bandwidth-bound: every step reads the whole KV of the context once. This prints, for a
32k-token context (Llama-2-7B-like head layout by default), the KV bytes the paged partial attention reads
per second, the same for torch SDPA over the same KV stored contiguously, and a 1 GiB ``copy_`` measured in
the same run, with ratios. Run: ``.venv/bin/python benchmarks/attention_bandwidth.py [--context 32768]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infinite_llm.core.attention import PartialAttentionMetadata, merge_partials, partial_attention


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def memcpy_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    sec = timed(lambda: dst.copy_(src), 5)
    return 2 * nbytes / sec / 1e9  # a copy reads and writes every byte


def make_meta(block_ids: torch.Tensor, context: int, block_size: int) -> PartialAttentionMetadata:
    n = block_ids.numel()
    return PartialAttentionMetadata(
        query_start_loc=torch.tensor([0, 1]),
        query_positions=torch.tensor([context - 1]),
        block_ids=block_ids[None, :],
        block_indices=torch.arange(n)[None, :],
        num_blocks=torch.tensor([n]),
        context_lens=torch.tensor([context]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768, help="tokens of KV (default 32768)")
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--partitions", type=int, default=4, help="also time a split into this many parts + merge")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.manual_seed(0)
    num_blocks = -(-a.context // a.block_size)
    shape = (num_blocks, a.block_size, a.num_kv_heads, a.head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    block_ids = torch.randperm(num_blocks)  # a realistic, scattered block table
    q = torch.randn(1, a.num_heads, a.head_dim)
    kv_bytes = 2 * a.context * a.num_kv_heads * a.head_dim * 4

    meta = make_meta(block_ids, a.context, a.block_size)
    paged = timed(lambda: partial_attention(q, k_cache, v_cache, meta), a.repeat)

    parts = torch.tensor_split(block_ids, a.partitions)
    metas = []
    start = 0
    for p in parts:
        m = make_meta(p, a.context, a.block_size)
        metas.append(
            PartialAttentionMetadata(
                m.query_start_loc,
                m.query_positions,
                m.block_ids,
                torch.arange(start, start + p.numel())[None, :],
                m.num_blocks,
                m.context_lens,
            )
        )
        start += p.numel()

    def split_and_merge():
        outs, lses = zip(*(partial_attention(q, k_cache, v_cache, m) for m in metas), strict=True)
        return merge_partials(list(outs), list(lses))

    split = timed(split_and_merge, a.repeat)
    k_flat = (
        k_cache[block_ids]
        .flatten(0, 1)[: a.context]
        .transpose(0, 1)
        .repeat_interleave(a.num_heads // a.num_kv_heads, 0)
        .contiguous()
    )
    v_flat = (
        v_cache[block_ids]
        .flatten(0, 1)[: a.context]
        .transpose(0, 1)
        .repeat_interleave(a.num_heads // a.num_kv_heads, 0)
        .contiguous()
    )
    qs = q.transpose(0, 1)[:, None] if False else q.transpose(0, 1)  # (H, 1, D)
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k_flat, v_flat), a.repeat)
    sdpa_bytes = 2 * a.context * a.num_heads * a.head_dim * 4  # SDPA reads K/V expanded to every query head

    copy = memcpy_gbps()
    print(
        f"context {a.context} tokens, {a.num_heads} heads / {a.num_kv_heads} KV heads x {a.head_dim}, "
        f"block_size {a.block_size}, fp32, threads {torch.get_num_threads()}"
    )
    print(f"KV bytes per layer and step: {kv_bytes / 2**20:.1f} MiB")
    rows = [
        ("memcpy (torch copy_, 1 GiB)", None, copy),
        ("paged partial attention, 1 part", paged, kv_bytes / paged / 1e9),
        (f"paged, {a.partitions} parts + merge", split, kv_bytes / split / 1e9),
        ("torch SDPA, contiguous K/V (expanded GQA)", sdpa, sdpa_bytes / sdpa / 1e9),
    ]
    print(f"{'what':44s} {'ms':>8s} {'GB/s':>8s} {'x memcpy':>9s}")
    for name, sec, gbps in rows:
        ms = f"{sec * 1e3:8.2f}" if sec is not None else f"{'':8s}"
        print(f"{name:44s} {ms} {gbps:8.2f} {gbps / copy:9.2f}")


if __name__ == "__main__":
    main()
