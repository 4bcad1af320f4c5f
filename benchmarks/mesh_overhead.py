"""Decode step time of the mesh (1 compute instance, 3 attention servers on loopback) vs the single-process
engine on the same model, at batch 1 and 16, with the per-layer remote-attention RPC time.

Both run in this run, one after the other, on SmolLM2-135M-Instruct fp32 (CPU). A decode step's time is
isolated from prefill by generating ``n`` and 1 new tokens and dividing the extra time by ``n - 1``. The
single-process engine uses 3 DistAttention partitions, so the only difference is the network hop.
Run: ``.venv/bin/python benchmarks/mesh_overhead.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import grpc
import torch
from engine_throughput import decode_step_seconds, prompts  # same workload and method, side by side

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.models.registry import load_model_files, resolve_model
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.state.etcd_launcher import free_port


def local_seconds(engine: LLMEngine, ids: list[list[int]], n: int) -> float:
    t = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return time.perf_counter() - t


def mesh_seconds(client: Client, ids: list[list[int]], n: int) -> float:
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        outs = list(pool.map(lambda p: client.generate(p, max_tokens=n, temperature=0, ignore_eos=True), ids))
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t


def step_ms(run, ids, n: int) -> float:
    return 1e3 * decode_step_seconds(run, ids, n)


def compute_stats(address: str) -> cpb.ComputeStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return cgrpc.ComputeInstanceStub(ch).GetStats(cpb.ComputeStatsRequest(), timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args()
    cfg, state_dict, tokenizer = load_model_files(resolve_model(None), torch.float32)
    engine = LLMEngine.from_weights(cfg, state_dict, tokenizer, EngineConfig(num_partitions=3))
    mesh = LocalMesh(
        MeshConfig(attention_servers=3, compute_instances=1, kv_memory_bytes=256 << 20, router_port=free_port())
    )
    rows = []
    with mesh, Client(mesh.router_address) as client:
        compute = mesh.compute_instances()[0].address
        for batch in a.batches:
            ids = prompts(tokenizer, batch)
            local = step_ms(lambda i, n: local_seconds(engine, i, n), ids, a.new_tokens)
            before = compute_stats(compute)
            remote = step_ms(lambda i, n: mesh_seconds(client, i, n), ids, a.new_tokens)
            after = compute_stats(compute)
            calls = after.layer_rpc_count - before.layer_rpc_count
            per_layer = 1e3 * (after.layer_rpc_seconds - before.layer_rpc_seconds) / max(calls, 1)
            rows.append((batch, local, remote, per_layer))
    print(
        f"model {resolve_model(None).name}, fp32, {cfg.num_hidden_layers} layers, {a.new_tokens} new tokens; "
        f"mesh: 1 compute + 3 attention servers on loopback; local: 3 partitions in one process"
    )
    print(
        f"{'batch':>5s} {'local ms/step':>14s} {'mesh ms/step':>13s} {'mesh/local':>11s} "
        f"{'RPC ms/layer':>13s} {'RPC share':>10s}"
    )
    for batch, local, remote, per_layer in rows:
        share = per_layer * cfg.num_hidden_layers / remote
        print(f"{batch:5d} {local:14.1f} {remote:13.1f} {remote / local:11.2f} {per_layer:13.2f} {share:10.0%}")
    print(
        "RPC ms/layer: wall time of one layer's fan-out to every attention server of the batch (all steps, "
        "prefill included); RPC share: 30 of them over a decode step."
    )


if __name__ == "__main__":
    main()
