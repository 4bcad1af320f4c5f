"""Soak: concurrent greedy streams for a while on a local mesh, then count what leaked (issue 11).

Starts ``infinite-llm up``'s mesh (etcd, manager, attention servers, one compute instance, router; mTLS),
then runs ``--streams`` client threads for ``--duration`` seconds. Each thread streams greedy requests over
a rotating set of prompts (slices of the Apache-2.0 text, 20 to ~300 tokens) with ``max_tokens`` drawn
from ``[8, --max-tokens]`` (seeded), and checks that the streamed token ids equal the non-streamed greedy
output of the same request (no lost or duplicated tokens). Once the streams end it waits up to two lease
periods for the ledger to empty and every rBlock to come back, then counts what stayed: ledger entries and
rBlocks used or reserved on any attention server.

Figures printed: requests, tokens, tokens/s, mismatches, errors by type, ledger entries and rBlocks left.
The last line reads ``soak: N requests, E errors, L leaked blocks`` (mismatches count as errors; L counts
rBlocks and ledger entries left). Run: ``.venv/bin/python benchmarks/soak.py`` (8 streams, 5 minutes);
``--duration 30`` for a quick check.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from infinite_llm.client import Client
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.services.admin import cluster_state
from infinite_llm.state.etcd_launcher import free_port

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()
GREEDY = dict(temperature=0, ignore_eos=True)


@dataclass
class Tally:
    """What the stream threads saw; one lock guards it."""

    requests: int = 0
    tokens: int = 0
    mismatches: int = 0
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


class References:
    """The non-streamed greedy output of each (prompt, max_tokens), computed once through the router."""

    def __init__(self, client: Client) -> None:
        self._client, self._cache, self._lock = client, {}, threading.Lock()

    def get(self, prompt: str, max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        ids = self._client.generate(prompt, max_tokens=max_tokens, timeout=600, **GREEDY).token_ids
        with self._lock:
            return self._cache.setdefault(key, ids)


def prompts(n: int = 12) -> list[str]:
    """``n`` prompts of growing length (20 to ~300 tokens), from distinct parts of the text."""
    return [TEXT[i * 700 : i * 700 + 100 + i * 110] for i in range(n)]


def stream_worker(client: Client, refs: References, tally: Tally, deadline: float, seed: int, max_tokens: int) -> None:
    """Stream requests until ``deadline`` (monotonic seconds); compare each with its reference."""
    rng, texts = random.Random(seed), prompts()
    while time.monotonic() < deadline:
        prompt, n = rng.choice(texts), rng.randint(8, max_tokens)
        try:
            streamed = [
                t for chunk in client.stream(prompt, max_tokens=n, timeout=600, **GREEDY) for t in chunk.token_ids
            ]
            ok = streamed == refs.get(prompt, n)
        except Exception as e:  # noqa: BLE001 - counted by type
            with tally.lock:
                tally.requests += 1
                tally.errors[type(e).__name__] += 1
            continue
        with tally.lock:
            tally.requests += 1
            tally.tokens += len(streamed)
            tally.mismatches += not ok


def leftovers(mesh: LocalMesh) -> tuple[int, int]:
    """``(ledger entries, rBlocks used or reserved on live attention servers)``."""
    entries = len(cluster_state(mesh.manager_address, tls=mesh.tls("client")).ledger)
    blocks = 0
    for p in mesh.attention_servers():
        if p.alive():
            with sync_channel(p.address, tls=mesh.tls("manager")) as ch:
                s = agrpc.AttentionServerStub(ch).GetStats(apb.GetStatsRequest(), timeout=10)
            blocks += s.num_used + s.num_reserved
    return entries, blocks


def settle(mesh: LocalMesh, timeout_s: float) -> tuple[int, int]:
    """Leftovers once they reach zero, or as they are after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = leftovers(mesh)
        except grpc.RpcError:
            left = (-1, -1)
        if left == (0, 0) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of a request")
    ap.add_argument("--attention-servers", type=int, default=3)
    ap.add_argument("--kv-memory", type=int, default=64 << 20, help="bytes per attention server")
    ap.add_argument("--member-ttl", type=int, default=10, help="lease of members (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = MeshConfig(
        attention_servers=args.attention_servers,
        kv_memory_bytes=args.kv_memory,
        router_port=free_port(),
        gateway_port=0,
        member_ttl_s=args.member_ttl,
    )
    with LocalMesh(config) as mesh, Client(mesh.router_address, tls=mesh.tls("client")) as client:
        tally, refs = Tally(), References(client)
        started = time.monotonic()
        deadline = started + args.duration
        threads = [
            threading.Thread(target=stream_worker, args=(client, refs, tally, deadline, args.seed + i, args.max_tokens))
            for i in range(args.streams)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        entries, blocks = settle(mesh, 2 * args.member_ttl)
    errors = sum(tally.errors.values()) + tally.mismatches
    print(f"streams: {args.streams} for {elapsed:.0f} s (asked {args.duration:.0f} s)")
    print(f"requests: {tally.requests}, tokens streamed: {tally.tokens} ({tally.tokens / elapsed:.1f} tok/s)")
    print(f"streamed != non-streamed greedy: {tally.mismatches}; errors: {dict(tally.errors) or 0}")
    print(f"left after the load: {entries} ledger entries, {blocks} rBlocks used or reserved")
    if entries < 0:
        raise SystemExit(
            f"soak: {tally.requests} requests, {errors} errors; leaked blocks unknown (manager unreachable)"
        )
    print(f"soak: {tally.requests} requests, {errors} errors, {entries + blocks} leaked blocks")


if __name__ == "__main__":
    main()
