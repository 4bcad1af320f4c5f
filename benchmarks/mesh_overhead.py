"""Decode step time of the mesh (1 compute instance, 3 attention servers on loopback) vs the single-process
engine on the same model, at batch 1 and 16, with both attention transports side by side: tensors inline
in the gRPC stream (``grpc``) and on gloo tensor channels with gRPC keeping the control (``torch``).

All three run in this run on SmolLM2-135M-Instruct fp32 (CPU), one measurement at a time.
A decode step's time is isolated from prefill by generating ``n`` and 1 new tokens and dividing the extra
time by ``n - 1``; the same difference isolates a decode step's fan-out time and CPU. Beside the wall times
the run prints where the CPU went per decode step: the in-process engine's, and in each mesh the compute
instance's and the three attention servers' (user + system seconds from ``/proc``), with how many of the
machine's cores every process together kept busy. On a machine with few cores this shows what sets the
mesh's step: the servers' CPU per layer and the wake-ups between processes, not the bytes on the wire.
The single-process engine uses 3 DistAttention partitions, so the only difference is the
hop to the attention servers. Both meshes stay up for the whole run, and ``--repeats`` rounds (default 3)
each measure every batch on the three sides back to back, in an order that rotates between rounds. The
tables show each side's fastest round (a shared machine's noise only ever slows a run down); the ratios
that decide are paired: mesh over local within one round, whose median over the rounds is printed with
its range. The last line reads ``mesh/local batch 16: grpc X.XXx torch Y.YYx`` (those medians). Before
2026-12-04 the meshes ran one after the other, between two local runs, and the last line divided the
fastest of each side: on this 2-core machine the same code gave 1.33x to 1.92x at batch 16 (torch) within
an hour: the machine's speed drifts by more than the mesh's overhead between measurements minutes apart.
Run: ``.venv/bin/python benchmarks/mesh_overhead.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from engine_throughput import decode_step_seconds, prompts  # same workload and method, side by side

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.mesh import SERVICE_NICE, LocalMesh, MeshConfig
from infinite_llm.models.registry import load_model_files, resolve_model
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.state.etcd_launcher import free_port


def local_run(engine: LLMEngine, ids: list[list[int]], n: int) -> None:
    engine.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def mesh_seconds(client: Client, ids: list[list[int]], n: int) -> float:
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        outs = list(pool.map(lambda p: client.generate(p, max_tokens=n, temperature=0, ignore_eos=True), ids))
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t


def step_ms(run, ids, n: int) -> float:  # noqa: ANN001
    return 1e3 * decode_step_seconds(run, ids, n)


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of process ``pid`` so far, its finished threads included (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """CPU seconds of every process on the machine so far (``/proc``; one that ends meanwhile is skipped)."""
    total = 0.0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                total += cpu_seconds(entry.name)
            except (OSError, IndexError, ValueError):
                continue
    return total


@dataclass(frozen=True)
class Counters:
    """Cumulative counters read around a run: fan-out seconds and count (``DistAttention``), CPU seconds of
    the compute side (the local engine's process, or the compute instance) and of the attention servers,
    and of the whole machine."""

    wall: float
    fan_out_s: float
    fan_outs: int
    compute_cpu: float
    servers_cpu: float
    machine_cpu: float

    def minus(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self.__dict__.values(), other.__dict__.values(), strict=True)))


@dataclass(frozen=True)
class DecodeStep:
    """One decode step, from ``run(n) - run(1)`` over ``n - 1`` steps: wall ms, ms per layer fan-out, CPU ms
    of the compute side and of the attention servers, and the machine's busy cores meanwhile."""

    ms: float
    fan_out_ms: float
    compute_cpu_ms: float
    servers_cpu_ms: float
    cores: float


def decode_step(run: Callable[[list[list[int]], int], object], ids, n: int, read: Callable[[], Counters]) -> DecodeStep:  # noqa: ANN001
    """engine_throughput's method (``run(ids, n)`` minus ``run(ids, 1)``, one warm-up), with counters."""
    run(ids, 2)
    c0 = read()
    run(ids, n)
    c1 = read()
    run(ids, 1)
    c2 = read()
    d = c1.minus(c0).minus(c2.minus(c1))  # the n - 1 decode steps alone
    steps = n - 1
    return DecodeStep(
        ms=1e3 * max(d.wall, 1e-9) / steps,
        fan_out_ms=1e3 * d.fan_out_s / max(d.fan_outs, 1),
        compute_cpu_ms=1e3 * d.compute_cpu / steps,
        servers_cpu_ms=1e3 * d.servers_cpu / steps,
        cores=d.machine_cpu / max(d.wall, 1e-9),
    )


def compute_stats(address: str, tls) -> cpb.ComputeStatsResponse:  # noqa: ANN001
    with sync_channel(address, tls=tls) as ch:  # a compute instance answers the router's role
        return cgrpc.ComputeInstanceStub(ch).GetStats(cpb.ComputeStatsRequest(), timeout=10)


@contextlib.contextmanager
def mesh_meter(  # noqa: ANN001
    transport: str, tokenizer, new_tokens: int, service_nice: int = SERVICE_NICE
) -> Iterator[Callable[[int], DecodeStep]]:
    """A fresh mesh using ``transport``, as a function ``batch -> DecodeStep`` measuring one decode step of
    ``batch`` sequences through it. On leaving, warns when a server's tensors fell back to gRPC."""
    config = MeshConfig(
        attention_servers=3,
        compute_instances=1,
        kv_memory_bytes=256 << 20,
        router_port=free_port(),
        transport=transport,
        prefix_caching=False,  # the runs repeat their prompts: each side prefills them in full, as HF would
        service_nice=service_nice,
    )
    with LocalMesh(config) as mesh, Client(mesh.router_address, tls=mesh.tls("client")) as client:
        compute = mesh.compute_instances()[0]
        servers = [p.popen.pid for p in mesh.attention_servers()]

        def read() -> Counters:
            stats = compute_stats(compute.address, mesh.tls("router"))
            return Counters(
                time.perf_counter(),
                stats.layer_rpc_seconds,
                stats.layer_rpc_count,
                cpu_seconds(compute.popen.pid),
                sum(map(cpu_seconds, servers)),
                machine_cpu_seconds(),
            )

        def measure(batch: int) -> DecodeStep:
            return decode_step(lambda i, n: mesh_seconds(client, i, n), prompts(tokenizer, batch), new_tokens, read)

        yield measure
        fell_back = "tensors travel over gRPC" in (mesh.log_dir / "compute-0.log").read_text(encoding="utf-8")
    if fell_back:
        print(f"warning: the {transport} mesh fell back to gRPC for some attention server (see its compute log)")


def paired_ratios(rounds: list[dict[str, DecodeStep]], side: str) -> list[float]:
    """``side``'s ms per step over the local engine's, one ratio per round (both measured back to back)."""
    return [r[side].ms / r["local"].ms for r in rounds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--service-nice", type=int, default=SERVICE_NICE, help="niceness of the mesh's services but compute (0: off)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds: each measures every batch on the local engine and both meshes back to back",
    )
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    cfg, state_dict, tokenizer = load_model_files(resolve_model(None), torch.float32)
    engine = LLMEngine.from_weights(
        cfg, state_dict, tokenizer, EngineConfig(num_partitions=3, enable_prefix_caching=False)
    )

    def read() -> Counters:
        kv = engine.kv
        cpu = cpu_seconds()
        return Counters(time.perf_counter(), kv.fan_out_seconds, kv.fan_out_count, cpu, 0.0, machine_cpu_seconds())

    def local_step(b: int) -> DecodeStep:
        return decode_step(lambda i, n: local_run(engine, i, n), prompts(tokenizer, b), a.new_tokens, read)

    # Both meshes stay up (idle but for heartbeats while the others run) so that every round measures the
    # three sides back to back, in a rotating order: a ratio is only ever taken between neighbours in time.
    sides = ("local", "grpc", "torch")
    rounds: dict[int, list[dict[str, DecodeStep]]] = {b: [] for b in a.batches}
    with (
        mesh_meter("grpc", tokenizer, a.new_tokens, a.service_nice) as grpc_step,
        mesh_meter("torch", tokenizer, a.new_tokens, a.service_nice) as torch_step,
    ):
        meters = {"local": local_step, "grpc": grpc_step, "torch": torch_step}
        for r in range(a.repeats):
            order = sides[r % 3 :] + sides[: r % 3]
            for b in a.batches:
                rounds[b].append({side: meters[side](b) for side in order})
    fastest = {b: {side: min((r[side] for r in rounds[b]), key=lambda s: s.ms) for side in sides} for b in a.batches}
    local = {b: fastest[b]["local"] for b in a.batches}
    mesh = {t: {b: fastest[b][t] for b in a.batches} for t in ("grpc", "torch")}
    print(
        f"model {resolve_model(None).name}, fp32, {cfg.num_hidden_layers} layers, {a.new_tokens} new tokens, "
        f"the fastest of {a.repeats} measurements each; "
        f"mesh: 1 compute + 3 attention servers on loopback, the others at nice {a.service_nice}; "
        "local: 3 partitions in one process"
    )
    print(
        f"{'batch':>5s} {'local ms/step':>14s} {'grpc ms/step':>13s} {'torch ms/step':>14s} {'grpc/local':>11s} "
        f"{'torch/local':>12s} {'grpc ms/layer':>14s} {'torch ms/layer':>15s}"
    )
    for b in a.batches:
        lo, g, t = local[b].ms, mesh["grpc"][b], mesh["torch"][b]
        print(
            f"{b:5d} {lo:14.1f} {g.ms:13.1f} {t.ms:14.1f} {g.ms / lo:11.2f} {t.ms / lo:12.2f} "
            f"{g.fan_out_ms:14.2f} {t.fan_out_ms:15.2f}"
        )
    print(
        "ms/layer: wall time of one layer's fan-out to every attention server of the batch and the merge (decode "
        f"steps); {cfg.num_hidden_layers} of them make a step."
    )
    print(f"\nwhere a decode step's time and CPU went ({os.cpu_count()} cores on this machine):")
    print(
        f"{'batch':>5s} {'run':>6s} {'ms/step':>8s} {'fan-out ms/layer':>17s} {'compute CPU ms':>15s} "
        f"{'servers CPU ms':>15s} {'busy cores':>11s}"
    )
    for b in a.batches:
        for name, r in (("local", local[b]), ("grpc", mesh["grpc"][b]), ("torch", mesh["torch"][b])):
            print(
                f"{b:5d} {name:>6s} {r.ms:8.1f} {r.fan_out_ms:17.2f} {r.compute_cpu_ms:15.1f} "
                f"{r.servers_cpu_ms:15.1f} {r.cores:11.2f}"
            )
    print(
        "CPU ms per decode step: compute = the local engine's process, or the compute instance (dense layers, "
        "fan-out and merge); servers = the 3 attention servers together; busy cores = every process's CPU "
        "over the wall time."
    )
    cores = os.cpu_count() or 1
    for b in a.batches:
        floor = {t: (runs[b].compute_cpu_ms + runs[b].servers_cpu_ms) / cores / local[b].ms for t, runs in mesh.items()}
        print(
            f"batch {b}: the mesh's CPU per step spread evenly over all {cores} cores takes grpc "
            f"{floor['grpc']:.2f}x, torch {floor['torch']:.2f}x local's step: the mesh steps no faster here "
            "unless it spends less CPU (its layers are sequential, so in practice the cores are not all busy; "
            "OpenMP's spin-waits count as CPU, which at batch 1 inflates local's)"
        )
    print(
        f"\nmesh/local paired by round ({a.repeats} rounds; each measures local, grpc and torch back to back, "
        "in a rotating order): median (range)"
    )
    median = {}
    for b in a.batches:
        line = []
        for t in ("grpc", "torch"):
            ratios = paired_ratios(rounds[b], t)
            median[b, t] = statistics.median(ratios)
            line.append(f"{t} {median[b, t]:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"batch {b}: " + ", ".join(line))
    b = max(a.batches)
    print(f"mesh/local batch {b}: grpc {median[b, 'grpc']:.2f}x torch {median[b, 'torch']:.2f}x")


if __name__ == "__main__":
    main()
