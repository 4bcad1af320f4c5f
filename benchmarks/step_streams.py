"""The gRPC data plane's per-step cost: one long-lived AttendStream per attention server (StepEnd between
steps, the default) vs one stream per step (how every step ran before, and how a server of an older build
is still served), side by side in one run.

Three attention-server processes on loopback (SmolLM2-135M's KV shape: 30 layers, 3 KV heads x 64, fp32,
block_size 16; no model weights: the compute side is a ``DistAttention`` over ``GrpcTransport`` sending
random queries and new K/V, as a compute instance's layers would), rBlocks round robin so that every
decode step reaches every server. Each round runs ``--steps`` decode steps of ``--batch`` sequences (~100
tokens of context each) in both modes, in alternating order; it prints the median ms per step of each mode,
the threads started per step, and the ratio. The attention and the codec are the same in both modes: the
difference is opening the streams.

    python benchmarks/step_streams.py [--rounds 3] [--steps 40] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from engine_gpu import SMOKE
from mesh_gpu import RoundRobinPlacement, attention_servers

from infinite_llm.core.dist_attention import DistAttention, HolderId
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.services.compute.grpc_transport import GrpcTransport, StepStream

SHAPE = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64, "num_attention_heads": 9}
BLOCK_SIZE = 16
CONTEXT = 100  # tokens of each sequence before the measured steps
BLOCKS_PER_SEQ = 16  # room for CONTEXT + the steps of every round (256 tokens)


class OneStreamPerStep(GrpcTransport):
    """The transport as a server of an older build gets it: every step opens its own streams."""

    def _stream(self, server: HolderId) -> StepStream:
        stream = super()._stream(server)
        stream.many = False  # half-closed at the step's end instead of a StepEnd
        return stream


class ThreadCount:
    """Counts ``threading.Thread.start`` calls while inside (the blocking gRPC API starts threads per call)."""

    def __enter__(self) -> ThreadCount:
        self.started = 0
        self._original = threading.Thread.start
        counter = self

        def start(thread: threading.Thread) -> None:
            counter.started += 1
            counter._original(thread)

        threading.Thread.start = start  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        threading.Thread.start = self._original  # type: ignore[method-assign]


def run_steps(dist: DistAttention, seqs: list[str], first: int, steps: int) -> list[float]:
    """``steps`` decode steps of ``seqs`` from position ``first``; seconds per step."""
    layers, heads, kv_heads, dim = (SHAPE[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim"))  # fmt: skip
    gen = torch.Generator().manual_seed(first)
    n = len(seqs)
    times = []
    for i in range(steps):
        plan = [SeqStep(s, first + i, 1) for s in seqs]
        q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        start = time.perf_counter()
        with dist.prepare(plan, num_heads=heads) as attention:
            for layer in range(layers):
                attention(layer, q, k, v)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="decode steps per mode per round")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    if CONTEXT + args.rounds * args.steps > BLOCKS_PER_SEQ * BLOCK_SIZE:
        parser.error(f"--rounds x --steps must be <= {BLOCKS_PER_SEQ * BLOCK_SIZE - CONTEXT}")
    work = replace(SMOKE, model={**SMOKE.model, **SHAPE}, block_size=BLOCK_SIZE)
    blocks = max(args.batches) * 2 * -(-BLOCKS_PER_SEQ // 3)  # per server: both modes' sequences, round robin
    print(f"3 attention servers on loopback, KV {SHAPE['num_hidden_layers']} layers x {SHAPE['num_key_value_heads']} "
          f"KV heads x {SHAPE['head_dim']} fp32, block_size {BLOCK_SIZE}, {CONTEXT} tokens of context, "
          f"{args.steps} decode steps per mode per round, {args.rounds} rounds")  # fmt: skip
    with attention_servers(work, "float32", "cpu", blocks) as servers:
        placement = RoundRobinPlacement({h: stub for h, (_, stub) in servers.items()}, blocks)
        addresses = {h: address for h, (address, _) in servers.items()}
        modes = {
            "one stream per server": GrpcTransport(lambda h: addresses[h], timeout_s=30),
            "one stream per step": OneStreamPerStep(lambda h: addresses[h], timeout_s=30),
        }
        for batch in args.batches:
            dists = {m: DistAttention(placement, t, BLOCK_SIZE) for m, t in modes.items()}
            seqs = {m: [f"mode{j}-{batch}-{i}" for i in range(batch)] for j, m in enumerate(modes)}
            for m, dist in dists.items():
                for s in seqs[m]:
                    assert dist.try_allocate(s, BLOCKS_PER_SEQ)
                run_steps(dist, seqs[m], CONTEXT - 4, 4)  # warm-up: connections, streams
            times: dict[str, list[float]] = {m: [] for m in modes}
            threads = dict.fromkeys(modes, 0)
            ratios = []
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                medians = {}
                for m in order:
                    with ThreadCount() as count:
                        t = run_steps(dists[m], seqs[m], CONTEXT + r * args.steps, args.steps)
                    threads[m] += count.started
                    times[m] += t
                    medians[m] = statistics.median(t)
                ratios.append(medians["one stream per step"] / medians["one stream per server"])
            for m in modes:
                ms = 1e3 * statistics.median(times[m])
                per_step = threads[m] / (args.rounds * args.steps)
                print(f"batch {batch:2d}: {m:22s} {ms:7.2f} ms a step (median), {per_step:4.1f} threads started a step")
            for m, dist in dists.items():
                for s in seqs[m]:
                    dist.free(s)
            mid, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
            print(f"batch {batch:2d}: per step / per server {mid:.2f}x (rounds {lo:.2f}-{hi:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
