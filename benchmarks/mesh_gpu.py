"""The mesh's data plane on a GPU, beside the in-process engine and HF transformers.

Attention servers run in their own processes computing on CUDA, and a compute engine on CUDA reaches them
through ``DistAttention`` over gRPC on loopback.

The model is ``engine_gpu.py``'s random-weight Llama-3.2-1B shape (no download). Three attention servers
run ``infinite_llm.services.attention.server.main`` (one process each, this run's ``--device``: the kernels
dispatcher picks Triton on CUDA), without a manager: rBlock ``i`` of every sequence goes to server
``i mod 3`` through the servers' own ReserveBlocks/CommitBlocks, so every block boundary is a server
boundary. It prints:

1. fp32 greedy tokens of the mesh vs HF ``generate`` (one prompt at a time) vs the in-process engine with 3
   partitions, prompts around block and server boundaries, all in one batch; then every rBlock is back on
   the servers' free lists;
2. bf16 decode tok/s at batch 1 and 16 (prompt 512): the in-process engine eager and with CUDA graphs, then
   the mesh with its servers on the GPU and with them on the CPU (the compute engine on the GPU both
   times: four processes sharing one GPU time-slice it), each with the ratios and the share of a step
   spent in the per-layer fan-out (send q/k/v, wait for every server's partial, merge).

Exits 0 without a GPU unless ``--device cpu`` (``--tiny``: the smoke test of the code path, seconds).
Needs torch, triton, transformers, grpcio and the serving packages of ``pyproject.toml``.

    python benchmarks/mesh_gpu.py [--device cpu --tiny]
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import torch
from engine_gpu import (
    FULL,
    SMOKE,
    TokenIdTokenizer,
    Workload,
    build_engine,
    build_hf,
    device_parser,
    parse_device_args,
    random_prompts,
    run_engine,
    run_hf,
)

from infinite_llm.core.dist_attention import BlockId, BlockRef, DistAttention, HolderId
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.models.hf import config_from_hf_dict
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as pb_grpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.services.compute.grpc_transport import GrpcTransport

NUM_SERVERS = 3
RPC_TIMEOUT_S = 30.0
SERVER_MAIN = (
    "import json, sys\n"
    "from infinite_llm.services.attention.server import AttentionServerConfig, main\n"
    "sys.exit(main(AttentionServerConfig(**json.loads(sys.argv[1]))))\n"
)
ROOT = Path(__file__).resolve().parent.parent


class RoundRobinPlacement:
    """rBlock ``i`` of a sequence on server ``i mod n``, reserved and committed on the server itself (the
    :class:`~infinite_llm.core.dist_attention.Placement` protocol without a global manager)."""

    def __init__(self, stubs: dict[HolderId, pb_grpc.AttentionServerStub], blocks_per_server: int) -> None:
        self.stubs = stubs
        self.num_total_blocks = self.num_free_blocks = len(stubs) * blocks_per_server

    def place(self, seq_id: str, n: int, first_index: int, near: HolderId | None = None) -> list[BlockRef]:
        servers = list(self.stubs)
        chosen = [servers[(first_index + i) % len(servers)] for i in range(n)]
        refs: list[BlockRef | None] = [None] * n
        for server in dict.fromkeys(chosen):
            rows = [i for i, s in enumerate(chosen) if s == server]
            stub = self.stubs[server]
            reserved = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id=seq_id, num_blocks=len(rows)), timeout=10)
            commit = pb.CommitBlocksRequest(
                reservation_id=reserved.reservation_id, block_indices=[first_index + i for i in rows]
            )
            stub.CommitBlocks(commit, timeout=10)
            for i, block_id in zip(rows, reserved.block_ids, strict=True):
                refs[i] = BlockRef(server, BlockId(block_id))
        self.num_free_blocks -= n
        return refs  # type: ignore[return-value]

    def release(self, seq_id: str, holders: Sequence[HolderId]) -> int:
        freed = sum(
            self.stubs[h].FreeSequence(pb.FreeSequenceRequest(seq_id=seq_id), timeout=10).num_freed for h in holders
        )
        self.num_free_blocks += freed
        return freed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def attention_servers(
    work: Workload, dtype: str, device: str, blocks_per_server: int
) -> Iterator[dict[HolderId, tuple[str, pb_grpc.AttentionServerStub]]]:
    """``NUM_SERVERS`` attention-server processes for ``work``'s model; yields id -> (address, stub)."""
    model = work.model
    head_dim = model["head_dim"]
    elem = 4 if dtype == "float32" else 2
    bytes_per_block = 2 * model["num_hidden_layers"] * work.block_size * model["num_key_value_heads"] * head_dim * elem
    procs, servers = [], {}
    try:
        for i in range(NUM_SERVERS):
            port = free_port()
            config = dict(
                server_id=f"attn-{i}", kv_memory_bytes=blocks_per_server * bytes_per_block,
                num_layers=model["num_hidden_layers"], num_kv_heads=model["num_key_value_heads"], head_dim=head_dim,
                dtype=dtype, block_size=work.block_size, port=port, device=device, drain_timeout_s=0, grace_s=1,
            )  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as LocalMesh runs its servers: no spinning pools
            procs.append(subprocess.Popen([sys.executable, "-c", SERVER_MAIN, json.dumps(config)], cwd=ROOT, env=env))
            address = f"127.0.0.1:{port}"
            servers[HolderId(config["server_id"])] = (address, pb_grpc.AttentionServerStub(sync_channel(address)))
        deadline = time.monotonic() + 120
        for address, stub in servers.values():
            while True:
                try:
                    stats = stub.GetStats(pb.GetStatsRequest(), timeout=2)
                    assert stats.num_free == blocks_per_server, (address, stats.num_free, blocks_per_server)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"attention server at {address} did not start") from None
                    time.sleep(0.2)
        yield servers
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def mesh_engine(hf, work: Workload, servers, dtype: torch.dtype, device: str, blocks_per_server: int) -> LLMEngine:
    """The engine of a compute instance: ``hf``'s weights, attention on ``servers`` over gRPC."""
    placement = RoundRobinPlacement({h: stub for h, (_, stub) in servers.items()}, blocks_per_server)
    addresses = {h: address for h, (address, _) in servers.items()}
    transport = GrpcTransport(lambda h: addresses[h], timeout_s=RPC_TIMEOUT_S)
    kv = DistAttention(placement, transport, work.block_size, device)
    config = EngineConfig(
        block_size=work.block_size, max_num_seqs=max(work.batches), max_num_batched_tokens=work.token_budget,
        dtype=dtype, device=device, enable_prefix_caching=False, placement_lookahead_blocks=0,
    )  # fmt: skip
    state_dict = {name: t.detach() for name, t in hf.state_dict().items()}
    model_config = config_from_hf_dict(hf.config.to_dict())
    return LLMEngine.from_weights(model_config, state_dict, TokenIdTokenizer(), config, kv)


def check_equality(hf, work: Workload, device: str, blocks: int) -> bool:
    """fp32 greedy tokens: mesh (one batch) vs HF (one prompt at a time) vs in-process engine (3 partitions)."""
    bs = work.block_size
    lengths = (1, bs - 1, bs, bs + 1, 3 * bs - 1, 3 * bs, 3 * bs + 1, 6 * bs + 5)  # around block/server edges
    prompts = [random_prompts(1, n, work.model["vocab_size"], seed=20 + n)[0] for n in lengths]
    want = [run_hf(hf, [p], work.eq_new_tokens).token_ids[0] for p in prompts]
    local = run_engine(build_engine(hf, work, torch.float32, device, num_partitions=3), prompts, work.eq_new_tokens)
    with attention_servers(work, "float32", device, blocks) as servers:
        engine = mesh_engine(hf, work, servers, torch.float32, device, blocks)
        got = run_engine(engine, prompts, work.eq_new_tokens).token_ids
        free = [stub.GetStats(pb.GetStatsRequest(), timeout=10) for _, stub in servers.values()]
    same = sum(g == w for g, w in zip(got, want, strict=True))
    same_local = sum(g == w for g, w in zip(local.token_ids, want, strict=True))
    freed = all(s.num_free == blocks and s.num_sequences == 0 for s in free)
    print(f"fp32 greedy, {len(prompts)} prompts of {list(lengths)} tokens x {work.eq_new_tokens}, block_size {bs}, "
          f"{NUM_SERVERS} servers round robin:")  # fmt: skip
    print(f"  mesh vs HF: {same}/{len(prompts)} equal; in-process (3 partitions) vs HF: {same_local}/{len(prompts)}")
    print(f"  every rBlock back on the free lists after: {'yes' if freed else 'NO'} "
          f"({[(s.num_free, s.num_sequences) for s in free]})")  # fmt: skip
    return same == len(prompts) and freed


def compare_decode(hf, work: Workload, device: str, blocks: int) -> None:
    """bf16 decode tok/s: the mesh (servers on ``device``, then on the CPU) vs the in-process engine eager and
    with CUDA graphs, per batch size; and where a mesh step goes (the per-layer fan-out vs the rest)."""
    hf = hf.to(torch.bfloat16)
    eager = build_engine(hf, work, torch.bfloat16, device, enforce_eager=True)
    graphs = build_engine(hf, work, torch.bfloat16, device) if device != "cpu" else None
    prompts = {b: random_prompts(b, work.prompt_len, work.model["vocab_size"], seed=b) for b in work.batches}
    print(f"bf16 decode tok/s, prompt {work.prompt_len}, {work.new_tokens} new tokens")
    local: dict[int, tuple[float, float]] = {}
    for batch in work.batches:
        for engine in (eager, graphs):
            if engine is not None:
                run_engine(engine, prompts[batch], 4)  # warm-up
        e = run_engine(eager, prompts[batch], work.new_tokens).decode_tok_s
        g = run_engine(graphs, prompts[batch], work.new_tokens).decode_tok_s if graphs is not None else float("nan")
        local[batch] = (e, g)
        print(f"  batch {batch:3d}: in-process eager {e:8.1f}  graphs {g:8.1f}")
    layers = work.model["num_hidden_layers"]
    server_devices = [device] + (["cpu"] if device != "cpu" else [])  # the second isolates GPU sharing
    for server_device in server_devices:
        with attention_servers(work, "bfloat16", server_device, blocks) as servers:
            mesh = mesh_engine(hf, work, servers, torch.bfloat16, device, blocks)
            kv = mesh.kv
            for batch in work.batches:
                run_engine(mesh, prompts[batch], 4)  # warm-up
                before = (kv.fan_out_seconds, kv.fan_out_count)
                m = run_engine(mesh, prompts[batch], work.new_tokens).decode_tok_s
                fan_s, fan_n = kv.fan_out_seconds - before[0], kv.fan_out_count - before[1]
                fan_ms = 1e3 * fan_s / max(fan_n, 1)  # the prefill's layers are in the mean too (1 step of ~65)
                e, g = local[batch]
                print(f"  batch {batch:3d}: mesh, servers on {server_device:4s} {m:8.1f}  mesh/eager {m / e:5.2f}  "
                      f"mesh/graphs {m / g:5.2f}  ({1e3 * batch / m:6.2f} ms a step; fan-out {fan_ms:5.2f} ms a "
                      f"layer x {layers} layers = {fan_ms * layers:6.2f} ms)")  # fmt: skip


def main() -> int:
    args = parse_device_args(device_parser(__doc__), "mesh_gpu.py")
    if args is None:
        return 0
    work = SMOKE if args.tiny else replace(FULL, batches=(1, 16), new_tokens=64)
    blocks = -(-work.kv_blocks // NUM_SERVERS) + 8
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = build_hf(work, args.device)
    ok = check_equality(hf, work, args.device, blocks)
    compare_decode(hf, work, args.device, blocks)
    print("equality: " + ("ok" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
