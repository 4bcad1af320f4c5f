"""Place round trips and decode step time of the mesh with placement lookahead off and on, side by side.

A compute instance asks the global manager for rBlocks with a ``Place`` call (a round trip and an etcd
transaction). With ``--placement-lookahead-blocks k`` a running sequence that needs an rBlock asks for up to
``k`` more in the same call, so its decode crosses ``k + 1`` block boundaries per ``Place``. This script
starts one local mesh per lookahead value (1 compute instance, 3 attention servers on loopback, gRPC
transport, SmolLM2-135M-Instruct fp32 on CPU), one after the other, and for each batch size prints the
``Place`` calls the manager counted per request (its ``placements_total``) over one run of ``--new-tokens``
tokens, and the decode step time measured as ``mesh_overhead.py`` does (``n`` minus 1 new tokens, over
``n - 1`` steps). The meshes run at different moments of a shared machine: the step times carry its swings;
the ``Place`` counts do not. The last line reads ``lookahead K vs 0, batch B: Place calls X.XXx, decode
step Y.YYx``.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/placement_lookahead.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os

import torch
from engine_throughput import prompts
from mesh_overhead import mesh_seconds, step_ms
from pooled_vs_static import scrape

from infinite_llm.client import Client
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.models.registry import load_model_files, resolve_model
from infinite_llm.state.etcd_launcher import free_port

LOOKAHEAD_ENV = "INFINITE_LLM_PLACEMENT_LOOKAHEAD_BLOCKS"  # read by `serve compute --placement-lookahead-blocks`


def placements(mesh: LocalMesh) -> float:
    """The manager's ``infinite_llm:placements_total`` (successful ``Place`` calls since it started)."""
    (manager,) = [p for p in mesh.procs if p.role == "manager"]
    return scrape(manager.metrics_address, "infinite_llm:placements_total")


def measure(lookahead: int, batches: list[int], tokenizer, new_tokens: int) -> dict[int, tuple[float, float]]:  # noqa: ANN001
    """``{batch: (Place calls per request over one run, ms per decode step)}`` on a fresh mesh."""
    os.environ[LOOKAHEAD_ENV] = str(lookahead)  # the mesh's compute instance inherits it
    config = MeshConfig(
        attention_servers=3, compute_instances=1, kv_memory_bytes=256 << 20, router_port=free_port(), gateway_port=0
    )
    out = {}
    with LocalMesh(config) as mesh, Client(mesh.router_address, tls=mesh.tls("client")) as client:
        for batch in batches:
            ids = prompts(tokenizer, batch)
            before = placements(mesh)
            mesh_seconds(client, ids, new_tokens)
            calls = (placements(mesh) - before) / batch
            out[batch] = (calls, step_ms(lambda i, n: mesh_seconds(client, i, n), ids, new_tokens))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lookahead", type=int, default=2, help="the value compared with 0 (the compute default: 2)")
    a = ap.parse_args()
    _, _, tokenizer = load_model_files(resolve_model(None), torch.float32)
    saved = os.environ.get(LOOKAHEAD_ENV)
    try:
        runs = {k: measure(k, a.batches, tokenizer, a.new_tokens) for k in (0, a.lookahead)}
    finally:
        if saved is None:
            os.environ.pop(LOOKAHEAD_ENV, None)
        else:
            os.environ[LOOKAHEAD_ENV] = saved
    print(
        f"model {resolve_model(None).name}, fp32, {a.new_tokens} new tokens; mesh: 1 compute + 3 attention servers "
        "on loopback (gRPC transport), one mesh per lookahead"
    )
    print(f"{'batch':>5s} {'lookahead':>9s} {'Place/request':>13s} {'ms/step':>8s}")
    for b in a.batches:
        for k, run in runs.items():
            print(f"{b:5d} {k:9d} {run[b][0]:13.2f} {run[b][1]:8.1f}")
    b, k = max(a.batches), a.lookahead
    (calls0, step0), (calls, step) = runs[0][b], runs[k][b]
    print(f"lookahead {k} vs 0, batch {b}: Place calls {calls / calls0:.2f}x, decode step {step / step0:.2f}x")


if __name__ == "__main__":
    main()
