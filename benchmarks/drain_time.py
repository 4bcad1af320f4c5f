"""How long a stopping attention server takes to drain, at the compute instance's drain budget and at the
background migration budget, on the local mesh (``infinite-llm up``'s: etcd, manager, 3 attention servers,
one compute instance, router; mTLS).

Per budget (``--budgets``, tokens per decode step; the compute instance's ``--drain-tokens-per-step`` through
``INFINITE_LLM_DRAIN_TOKENS_PER_STEP``) a fresh mesh serves one long greedy stream (``--prompt-tokens`` of
the Apache-2.0 text, then ``--new-tokens``); once it decodes, the attention server holding most of its
rBlocks gets SIGTERM. Printed per budget: the rBlocks it held, seconds from SIGTERM to its exit, the drain
time its log reports, whether it emptied (``drained``) or gave up, and whether the stream's tokens equal a
stream of the same request on an undisturbed mesh (the first budget's mesh, before the stop). The last line
reads ``drain at B1 vs B2 tokens/step: X.XXx the time`` (B2's seconds over B1's).
Run: ``.venv/bin/python benchmarks/drain_time.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import threading
import time

from infinite_llm.client import Client
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.models.registry import load_tokenizer, resolve_model
from infinite_llm.services.admin import cluster_state
from infinite_llm.state.etcd_launcher import free_port

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()
GREEDY = dict(temperature=0, ignore_eos=True)
DRAINED = re.compile(r"drained in ([0-9.]+) s")
GAVE_UP = re.compile(r"stopping after ([0-9.]+) s of drain")


def fullest_server(mesh: LocalMesh) -> tuple[str, int]:
    """The attention server the ledger places most rBlocks on, and how many."""
    held: dict[str, int] = {}
    for entry in cluster_state(mesh.manager_address, tls=mesh.tls("client")).ledger:
        for share in entry.shares:
            held[share.server_id] = held.get(share.server_id, 0) + share.num_blocks
    return max(held.items(), key=lambda kv: kv[1]) if held else ("", 0)


def one_budget(args: argparse.Namespace, budget: int, prompt: list[int], reference: list[int] | None) -> dict:
    os.environ["INFINITE_LLM_DRAIN_TOKENS_PER_STEP"] = str(budget)
    config = MeshConfig(
        attention_servers=3,
        kv_memory_bytes=args.kv_memory,
        router_port=free_port(),
        gateway_port=0,
        member_ttl_s=args.member_ttl,
    )
    with LocalMesh(config) as mesh, Client(mesh.router_address, tls=mesh.tls("client")) as client:
        if reference is None:  # the undisturbed stream, on the first mesh before anything stops
            reference = client.generate(prompt, max_tokens=args.new_tokens, timeout=900, **GREEDY).token_ids
        out: list[int] = []
        decoding = threading.Event()

        def stream() -> None:
            for chunk in client.stream(prompt, max_tokens=args.new_tokens, timeout=900, **GREEDY):
                out.extend(chunk.token_ids)
                decoding.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        decoding.wait(timeout=600)
        time.sleep(1.0)  # a few decode steps: the ledger lists the sequence's rBlocks
        name, blocks = fullest_server(mesh)
        server = next(p for p in mesh.attention_servers() if p.name == name)
        stopped = time.monotonic()
        server.popen.terminate()
        server.popen.wait(timeout=300)
        exit_s = time.monotonic() - stopped
        ended_first = not streamer.is_alive()
        streamer.join()
        log = server.log_path.read_text()
        drained, gave_up = DRAINED.search(log), GAVE_UP.search(log)
    return {
        "budget": budget,
        "server": name,
        "rblocks": blocks,
        "exit_s": exit_s,
        "drain_s": float((drained or gave_up).group(1)) if (drained or gave_up) else float("nan"),
        "drained": bool(drained),
        "same": out == reference,
        "ended_first": ended_first,
        "reference": reference,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="16,256", help="drain budgets to compare (tokens per decode step)")
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--new-tokens", type=int, default=300)
    ap.add_argument("--kv-memory", type=int, default=32 << 20, help="bytes per attention server")
    ap.add_argument("--member-ttl", type=int, default=5, help="lease of members (seconds)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    prompt = load_tokenizer(resolve_model(None)).encode(TEXT)[: args.prompt_tokens]
    mib = args.kv_memory >> 20
    print(f"prompt {len(prompt)} tokens + {args.new_tokens} new, greedy; 3 attention servers of {mib} MiB")
    rows, reference = [], None
    for budget in budgets:
        row = one_budget(args, budget, prompt, reference)
        reference = row["reference"]
        rows.append(row)
        print(
            f"budget {budget:>4} tokens/step: {row['server']} held {row['rblocks']} rBlocks; "
            f"exit {row['exit_s']:.1f} s after SIGTERM, drain {row['drain_s']:.1f} s "
            f"({'drained' if row['drained'] else 'gave up'}); "
            f"stream {'identical' if row['same'] else 'DIFFERENT'}"
            + ("; the stream ended first" if row["ended_first"] else "")
        )
    first, last = rows[0], rows[-1]
    ratio = last["drain_s"] / first["drain_s"]
    print(f"drain at {first['budget']} vs {last['budget']} tokens/step: {ratio:.2f}x the time")


if __name__ == "__main__":
    main()
