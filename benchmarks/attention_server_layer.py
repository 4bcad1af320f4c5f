"""Where one attention server's CPU goes per decode layer: its attention path measured in process, against
the same layers served by a real server process over gRPC on loopback, against a bare gRPC echo of the same
bytes (the transport's floor).

One decode step of ``--batch`` sequences, each holding ``--context`` tokens of KV on this server, SmolLM2-135M's
shape by default (30 layers, 9 query / 3 KV heads of 64, fp32). Every process computes on one OpenMP thread,
as the attention servers of ``LocalMesh`` do. Three measurements in one run, side by side:

1. in process, per layer: parse the ``AttendStreamRequest`` bytes, decode q/k/v, the layer checks, the
   holder's ``attend_layer`` (checks, K/V write, partial attention) and the reply's encoding;
2. a server started as ``AttentionServer`` in a child process (plaintext, no manager), driven by one
   ``AttendStream`` per step from this process: wall time per layer and both processes' CPU (``/proc``);
3. the same message sizes echoed by a ``grpc.aio`` server with a raw-bytes generic handler (no protobuf, no
   interceptors, no attention).

It prints the server's CPU per layer split into the attention path (1) and the rest (gRPC, asyncio, the
servicer, interceptors, and the attention path's own slowdown when it shares caches and the core with them:
2 minus 1), with the echo's CPU as that rest's floor. This is what bounds the mesh's
decode step on a machine with few cores (``benchmarks/mesh_overhead.py``). Run:
``PYTHONPATH=. .venv/bin/python benchmarks/attention_server_layer.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import queue
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator

CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
warnings.filterwarnings("ignore", message="The given buffer is not writable")  # the codec's views, on purpose


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="sequences in the decode step")
    p.add_argument("--context", type=int, default=48, help="tokens of KV each sequence holds on this server")
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed over gRPC (each all layers)")
    p.add_argument("--serve", choices=["attention", "echo"], help=argparse.SUPPRESS)  # the child's role
    p.add_argument("--reply-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the child processes -----------------------------------------------------------------------------------
async def serve_attention(args: argparse.Namespace) -> None:
    from infinite_llm.services.attention import AttentionServerConfig, start

    config = AttentionServerConfig(
        server_id="attn-0",
        kv_memory_bytes=256 << 20,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
    )
    server = await start(config)
    print(server.address, flush=True)
    await asyncio.Event().wait()


async def serve_echo(args: argparse.Namespace) -> None:
    import grpc

    reply = b"\0" * args.reply_bytes

    async def echo(request_iterator, context):  # noqa: ANN001, ANN202
        async for _ in request_iterator:
            yield reply

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo)  # raw bytes both ways
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def start_child(args: argparse.Namespace, role: str, reply_bytes: int = 0) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, __file__, "--serve", role, "--reply-bytes", str(reply_bytes)]
    cmd += ["--num-layers", str(args.num_layers), "--num-kv-heads", str(args.num_kv_heads)]
    cmd += ["--head-dim", str(args.head_dim), "--block-size", str(args.block_size)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **CHILD_ENV})
    address = child.stdout.readline().strip()
    if not address:
        child.kill()
        raise SystemExit(f"the {role} server did not start")
    return child, address


# ---- the measurements --------------------------------------------------------------------------------------
def timed_us(fn: Callable[[], object], n: int = 300) -> float:
    """CPU microseconds of one call of ``fn`` (this process, one thread), after 20 warm-up calls."""
    for _ in range(20):
        fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return 1e6 * (time.process_time() - start) / n


def layer_request(args: argparse.Namespace):  # noqa: ANN201 - pb.AttendStreamRequest
    import torch

    from infinite_llm.pb.v1 import attention_server_pb2 as pb
    from infinite_llm.rpc import codec

    b = args.batch
    layer = pb.LayerInput(layer=0)
    codec.encode_tensor(torch.randn(b, args.num_heads, args.head_dim), layer.query)
    codec.encode_tensor(torch.randn(b, args.num_kv_heads, args.head_dim), layer.key)
    codec.encode_tensor(torch.randn(b, args.num_kv_heads, args.head_dim), layer.value)
    return pb.AttendStreamRequest(layer=layer)


def seq_steps(args: argparse.Namespace) -> list[tuple[str, int]]:
    """``(seq_id, num_blocks)`` of the step's sequences; each decodes its token at position ``context``."""
    num_blocks = args.context // args.block_size + 1  # the new token's rBlock included
    return [(f"seq-{i}", num_blocks) for i in range(args.batch)]


def in_process(args: argparse.Namespace) -> dict[str, float]:
    """CPU microseconds per layer of each piece of the server's attention path, in this process."""
    import torch

    from infinite_llm.core.rmanager import KVLayout, SeqStep
    from infinite_llm.pb.v1 import attention_server_pb2 as pb
    from infinite_llm.rpc import codec
    from infinite_llm.services.attention.served_rmanager import ServedRManager
    from infinite_llm.services.attention.validation import check_layer

    torch.set_num_threads(1)
    layout = KVLayout(args.num_layers, args.block_size, args.num_kv_heads, args.head_dim)
    holder = ServedRManager.with_capacity(256 << 20, layout)
    for seq_id, num_blocks in seq_steps(args):
        holder.commit(holder.reserve(seq_id, num_blocks).reservation_id, list(range(num_blocks)))
    step = holder.open_step([SeqStep(s, args.context, 1) for s, _ in seq_steps(args)], args.num_heads)
    wire = layer_request(args).SerializeToString()
    msg = pb.AttendStreamRequest.FromString(wire).layer

    def decode() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(codec.decode_tensor(getattr(msg, f), field=f) for f in ("query", "key", "value"))

    q, k, v = decode()
    layers = itertools.cycle(range(args.num_layers))  # every layer of the pool in turn, as a step does
    out, lse = holder.attend_layer(step, 0, q, k, v)

    def encode() -> bytes:
        reply = pb.LayerPartial(layer=0)
        codec.encode_tensor(out, reply.partial_out)
        codec.encode_tensor(lse, reply.lse)
        return reply.SerializeToString()

    return {
        "parse request": timed_us(lambda: pb.AttendStreamRequest.FromString(wire)),
        "decode q/k/v": timed_us(decode),
        "holder.attend_layer": timed_us(lambda: holder.attend_layer(step, next(layers), q, k, v)),
        "  of which layer checks": timed_us(lambda: check_layer(step, q, k, v, layout)),
        "encode reply": timed_us(encode),
    }


def paced_stream(call: Callable[[Iterator], Iterator], first: list, layer: Callable[[int], object], n: int) -> None:
    """One stream: ``first`` messages, then ``n`` layers, each sent after the previous reply (as a step's
    layers are: layer ``l + 1`` needs layer ``l``'s output)."""
    replies: queue.Queue[None] = queue.Queue()

    def requests() -> Iterator:
        yield from first
        for i in range(n):
            yield layer(i)
            replies.get()

    for _ in call(requests()):
        replies.put(None)


def over_grpc(args: argparse.Namespace) -> dict[str, float]:
    """Wall ms, server CPU ms and client CPU ms per layer of ``args.steps`` steps on a real server."""
    from infinite_llm.pb.v1 import attention_server_pb2 as pb
    from infinite_llm.pb.v1 import attention_server_pb2_grpc as pb_grpc
    from infinite_llm.rpc.channels import sync_channel

    child, address = start_child(args, "attention")
    try:
        with sync_channel(address, tls=None) as channel:
            stub = pb_grpc.AttentionServerStub(channel)
            for seq_id, num_blocks in seq_steps(args):
                r = stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id=seq_id, num_blocks=num_blocks), timeout=30)
                stub.CommitBlocks(
                    pb.CommitBlocksRequest(reservation_id=r.reservation_id, block_indices=range(num_blocks)),
                    timeout=30,
                )
            seqs = [pb.StepSeq(seq_id=s, num_computed_tokens=args.context, num_new=1) for s, _ in seq_steps(args)]
            request = layer_request(args)

            def layer(i: int):  # noqa: ANN202
                request.layer.layer = i
                return request

            def step(step_id: int) -> None:
                opening = pb.AttendStreamRequest(open=pb.StepOpen(step_id=step_id, seqs=seqs, num_heads=args.num_heads))
                paced_stream(lambda it: stub.AttendStream(it, timeout=60), [opening], layer, args.num_layers)

            return measure(child.pid, lambda: [step(i) for i in range(args.steps)], args.steps * args.num_layers)
    finally:
        child.kill()
        child.wait()


def echo(args: argparse.Namespace, request_bytes: int, reply_bytes: int) -> dict[str, float]:
    from infinite_llm.rpc.channels import sync_channel

    child, address = start_child(args, "echo", reply_bytes)
    try:
        with sync_channel(address, tls=None) as channel:
            call = channel.stream_stream("/bench.Echo/Stream")  # raw bytes: no (de)serializers
            payload = b"\0" * request_bytes
            n = args.steps * args.num_layers

            def run() -> None:
                for _ in range(args.steps):
                    paced_stream(lambda it: call(it, timeout=60), [], lambda i: payload, args.num_layers)

            return measure(child.pid, run, n)
    finally:
        child.kill()
        child.wait()


def measure(pid: int, run: Callable[[], object], n: int) -> dict[str, float]:
    run()  # warm-up: connections, first steps
    server0, client0, wall0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    run()
    return {
        "wall": 1e3 * (time.perf_counter() - wall0) / n,
        "server": 1e3 * (cpu_seconds(pid) - server0) / n,
        "client": 1e3 * (time.process_time() - client0) / n,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        asyncio.run(serve_attention(args) if args.serve == "attention" else serve_echo(args))
        return
    os.environ.update(CHILD_ENV)  # torch reads OMP_NUM_THREADS at import: this process computes on one thread too
    import torch

    from infinite_llm.pb.v1 import attention_server_pb2 as pb

    request_bytes = layer_request(args).ByteSize()
    reply = pb.LayerPartial(layer=0)
    reply.partial_out.data = bytes(4 * args.batch * args.num_heads * args.head_dim)
    reply.lse.data = bytes(4 * args.batch * args.num_heads)
    print(
        f"decode layer: batch {args.batch}, {args.context} tokens of KV per sequence on the server, "
        f"{args.num_heads}/{args.num_kv_heads} heads of {args.head_dim}, fp32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread; request {request_bytes / 1024:.1f} KiB, "
        f"reply {reply.ByteSize() / 1024:.1f} KiB"
    )
    pieces = in_process(args)
    for name, us in pieces.items():
        print(f"  in process  {name:26s} {us:7.1f} us CPU per layer")
    path_ms = sum(us for name, us in pieces.items() if not name.startswith(" ")) / 1e3
    served = over_grpc(args)
    floor = echo(args, request_bytes, reply.ByteSize())
    for name, r in (("attention server over gRPC", served), ("bare gRPC echo, same bytes", floor)):
        print(
            f"  {name:28s} wall {r['wall']:.3f} ms/layer, server CPU {r['server']:.3f} ms/layer, "
            f"client CPU {r['client']:.3f} ms/layer"
        )
    rest = served["server"] - path_ms
    # /proc counts CPU in clock ticks (10 ms): a run too short to register any gets no ratio
    ratio = f"{rest / floor['server']:.2f}x" if floor["server"] > 0 else "n/a: too short to measure"
    print(
        f"server CPU per layer {served['server']:.3f} ms = attention path {path_ms:.3f} (in process) + "
        f"gRPC, asyncio and servicer {rest:.3f}; the echo's floor is {floor['server']:.3f} ({ratio})"
    )


if __name__ == "__main__":
    main()
