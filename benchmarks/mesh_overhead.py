"""Decode step time of the mesh (1 compute instance, 3 attention servers on loopback) vs the single-process
engine on the same model, at batch 1 and 16, with both attention transports side by side: tensors inline
in the gRPC stream (``grpc``) and on gloo tensor channels with gRPC keeping the control (``torch``).

All three run in this run, one after the other (one mesh at a time), on SmolLM2-135M-Instruct fp32 (CPU).
A decode step's time is isolated from prefill by generating ``n`` and 1 new tokens and dividing the extra
time by ``n - 1``. The single-process engine uses 3 DistAttention partitions, so the only difference is the
hop to the attention servers. The last line reads ``mesh/local batch 16: grpc X.XXx torch Y.YYx``.
Run: ``.venv/bin/python benchmarks/mesh_overhead.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

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


def compute_stats(address: str, tls) -> cpb.ComputeStatsResponse:  # noqa: ANN001
    with sync_channel(address, tls=tls) as ch:  # a compute instance answers the router's role
        return cgrpc.ComputeInstanceStub(ch).GetStats(cpb.ComputeStatsRequest(), timeout=10)


def measure_mesh(  # noqa: ANN001
    transport: str, batches: list[int], tokenizer, new_tokens: int, service_nice: int = SERVICE_NICE
) -> dict[int, tuple[float, float]]:
    """``{batch: (ms per decode step, ms per layer fan-out)}`` through a fresh mesh using ``transport``."""
    config = MeshConfig(
        attention_servers=3,
        compute_instances=1,
        kv_memory_bytes=256 << 20,
        router_port=free_port(),
        transport=transport,
        prefix_caching=False,  # the runs repeat their prompts: each side prefills them in full, as HF would
        service_nice=service_nice,
    )
    out = {}
    with LocalMesh(config) as mesh, Client(mesh.router_address, tls=mesh.tls("client")) as client:
        compute = mesh.compute_instances()[0].address
        for batch in batches:
            ids = prompts(tokenizer, batch)
            before = compute_stats(compute, mesh.tls("router"))
            remote = step_ms(lambda i, n: mesh_seconds(client, i, n), ids, new_tokens)
            after = compute_stats(compute, mesh.tls("router"))
            calls = after.layer_rpc_count - before.layer_rpc_count
            out[batch] = (remote, 1e3 * (after.layer_rpc_seconds - before.layer_rpc_seconds) / max(calls, 1))
        fell_back = "tensors travel over gRPC" in (mesh.log_dir / "compute-0.log").read_text(encoding="utf-8")
    if fell_back:
        print(f"warning: the {transport} mesh fell back to gRPC for some attention server (see its compute log)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--service-nice", type=int, default=SERVICE_NICE, help="niceness of the mesh's services but compute (0: off)"
    )
    a = ap.parse_args()
    cfg, state_dict, tokenizer = load_model_files(resolve_model(None), torch.float32)
    engine = LLMEngine.from_weights(
        cfg, state_dict, tokenizer, EngineConfig(num_partitions=3, enable_prefix_caching=False)
    )

    def local_ms(b: int) -> float:
        return step_ms(lambda i, n: local_seconds(engine, i, n), prompts(tokenizer, b), a.new_tokens)

    local = {b: local_ms(b) for b in a.batches}
    mesh = {t: measure_mesh(t, a.batches, tokenizer, a.new_tokens, a.service_nice) for t in ("grpc", "torch")}
    local = {b: min(local[b], local_ms(b)) for b in a.batches}  # best of before and after: other load drifts
    print(
        f"model {resolve_model(None).name}, fp32, {cfg.num_hidden_layers} layers, {a.new_tokens} new tokens; "
        f"mesh: 1 compute + 3 attention servers on loopback, the others at nice {a.service_nice}; "
        "local: 3 partitions in one process"
    )
    print(
        f"{'batch':>5s} {'local ms/step':>14s} {'grpc ms/step':>13s} {'torch ms/step':>14s} {'grpc/local':>11s} "
        f"{'torch/local':>12s} {'grpc ms/layer':>14s} {'torch ms/layer':>15s}"
    )
    for b in a.batches:
        (g, g_layer), (t, t_layer) = mesh["grpc"][b], mesh["torch"][b]
        print(
            f"{b:5d} {local[b]:14.1f} {g:13.1f} {t:14.1f} {g / local[b]:11.2f} {t / local[b]:12.2f} "
            f"{g_layer:14.2f} {t_layer:15.2f}"
        )
    print(
        "ms/layer: wall time of one layer's fan-out to every attention server of the batch (all steps, prefill "
        f"included); {cfg.num_hidden_layers} of them make a step."
    )
    b = max(a.batches)
    print(
        f"mesh/local batch {b}: grpc {mesh['grpc'][b][0] / local[b]:.2f}x torch {mesh['torch'][b][0] / local[b]:.2f}x"
    )


if __name__ == "__main__":
    main()
