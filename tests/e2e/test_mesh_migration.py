"""Live migration on a real mesh: a long sequence's rBlocks move between 3 attention servers while it decodes
(spread onto servers added after start, brought home when its home frees), and its greedy output equals the
single-process engine's; the manager counts the migrations and nothing stays held afterwards."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.mesh import LocalMesh
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import (
    BLOCKS_PER_SERVER,
    BYTES_PER_BLOCK,
    all_blocks_free,
    compute_stats,
    mesh_config,
    wait_until,
)
from tests.e2e.test_observability import scrape, value

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()


@pytest.fixture(scope="module")
def home_mesh(default_model_path):
    """compute-0 with one home server (attn-0, 8 rBlocks); attn-1 and attn-2 (16 rBlocks each) join after
    start, nobody's home. The 40 rBlocks hold each test's sequences whole (34 at most): a sequence preempted
    for memory would give up its rBlocks, and with them the move or re-attach a test waits for."""
    with LocalMesh(mesh_config(attention_servers=1, compute_instances=1)) as m:
        for name in ("attn-1", "attn-2"):
            m.spawn_attention(name, kv_memory_bytes=2 * BLOCKS_PER_SERVER * BYTES_PER_BLOCK)
        m.wait_registered(3)
        yield m


def test_long_sequence_migrates_mid_decode_and_keeps_its_greedy_output(home_mesh, make_engine):
    mesh = home_mesh
    local = make_engine(num_kv_blocks=512)
    tokens = local.tokenizer.encode(TEXT)
    short, long_ = tokens[:60], tokens[100:250]
    manager = next(p for p in mesh.procs if p.role == "manager")
    before = value(scrape(manager.metrics_address), "infinite_llm:migrations_total")
    params = dict(temperature=0, ignore_eos=True)
    with Client(mesh.router_address) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The short one takes 4 of the home's 8 rBlocks first; the long one gets the other 4 and spills onto
        # attn-1/attn-2. The planner spreads the spill over the two servers nobody calls home, and brings
        # rBlocks home once the short one ends, all while the long one decodes.
        first = pool.submit(client.generate, short, max_tokens=20, **params)
        time.sleep(0.5)
        second = pool.submit(client.generate, long_, max_tokens=180, **params)
        out_short, out_long = first.result(timeout=600), second.result(timeout=600)
    refs = [
        out.token_ids[:n]
        for out, n in zip(
            local.generate([short, long_], SamplingParams(max_tokens=180, **params)), (20, 180), strict=True
        )
    ]
    assert out_short.token_ids == refs[0]
    assert out_long.token_ids == refs[1]
    assert len(out_long.placement) >= 2  # its KV spanned servers
    moved = value(scrape(manager.metrics_address), "infinite_llm:migrations_total") - before
    assert moved >= 1, f"no migration happened (logs: {mesh.log_dir})"
    assert wait_until(lambda: all_blocks_free(mesh), timeout_s=20)


def test_a_shared_prefix_migrates_with_both_readers_and_keeps_their_greedy_output(home_mesh, make_engine):
    """Issue 13: "w" prefills a 9-block document that spills off compute-0's full home; "r" asks about the
    same document and reads w's cached rBlocks where they are. When the home frees, the planner brings one
    reader's rBlocks home; the shared ones land there cached, and the other reader is re-attached to them
    (the manager counts it) instead of keeping the copies away. Both greedy outputs equal the in-process
    engine's, and every rBlock is free afterwards."""
    mesh = home_mesh
    local = make_engine(num_kv_blocks=512)
    tokens = local.tokenizer.encode(TEXT)
    short, doc = tokens[:60], tokens[400 : 400 + 9 * 16]
    asked = doc + tokens[700:720]
    manager = next(p for p in mesh.procs if p.role == "manager")
    before = value(scrape(manager.metrics_address), "infinite_llm:reattached_rblocks_total")
    params = dict(temperature=0, ignore_eos=True)

    def stream(ids: list[int], n: int, started: threading.Event) -> list[int]:
        out = []
        for chunk in client.stream(ids, max_tokens=n, **params):
            out += chunk.token_ids
            started.set()
        return out

    hits_before, preempted_before = _compute_stats(mesh)
    w_started = threading.Event()
    with Client(mesh.router_address) as client, concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(client.generate, short, max_tokens=24, **params)  # fills most of the home
        time.sleep(0.5)
        writer = pool.submit(stream, doc, 150, w_started)
        assert w_started.wait(timeout=120), "w never started decoding"
        time.sleep(1.0)  # w's full rBlocks are published right after its prefill step
        reader = pool.submit(client.generate, asked, max_tokens=110, **params)
        out_short, out_w, out_r = first.result(timeout=600), writer.result(timeout=600), reader.result(timeout=600)
    hits, preempted = _compute_stats(mesh)
    assert preempted == preempted_before, "a reader was preempted: the mesh is too small for this test"
    assert hits - hits_before == 9 * 16, "r did not read w's cached document"
    # One batch: greedy decoding with ignore_eos makes the first n tokens of a longer output the n-token one.
    full = local.generate([short, doc, asked], SamplingParams(max_tokens=150, **params))
    want = [out.token_ids[:n] for out, n in zip(full, (24, 150, 110), strict=True)]
    assert [out_short.token_ids, out_w, out_r.token_ids] == want
    reattached = value(scrape(manager.metrics_address), "infinite_llm:reattached_rblocks_total") - before
    assert reattached >= 1, f"no reader followed a moved shared rBlock (logs: {mesh.log_dir})"
    # No step saw tables its servers disagree with: the engine would recompute (same tokens), which the e2e
    # conftest's check of step_recoveries_total fails this test for.
    assert wait_until(lambda: all_blocks_free(mesh), timeout_s=20)


def _compute_stats(mesh: LocalMesh) -> tuple[int, int]:
    """Prefix-cache hits (tokens) and preemptions of the mesh's compute instance."""
    (compute,) = mesh.compute_instances()
    stats = compute_stats(compute.address)
    return stats.prefix_cache_hits, stats.num_preemptions


def test_a_stopping_attention_server_drains_while_its_sequence_decodes(home_mesh, make_engine):
    """SIGTERM to an attention server that holds a decoding sequence's rBlocks (a rolling update, a node
    drain): it tells the manager, whose planner migrates them to the other servers while the sequence keeps
    decoding; the server exits 0 once empty, before the sequence ends. The greedy output equals the in-process
    engine's, no step is recomputed (the module's conftest checks step_recoveries_total), nothing stays held.
    Last in this module: the mesh has one lender fewer after it."""
    mesh = home_mesh
    local = make_engine(num_kv_blocks=512)
    prompt = local.tokenizer.encode(TEXT)[300:450]  # 10 rBlocks: 8 fill compute-0's home, the rest spill
    manager = next(p for p in mesh.procs if p.role == "manager")
    before = value(scrape(manager.metrics_address), "infinite_llm:migrations_total")
    params = dict(temperature=0, ignore_eos=True)
    started = threading.Event()

    def stream() -> list[int]:
        out = []
        for chunk in client.stream(prompt, max_tokens=100, **params):
            out += chunk.token_ids
            started.set()
        return out

    with Client(mesh.router_address) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(stream)
        assert started.wait(timeout=120), "the sequence never started decoding"
        assert wait_until(lambda: _lender_holding(mesh) is not None, timeout_s=30), "nothing spilled off the home"
        server = next(p for p in mesh.attention_servers() if p.name == _lender_holding(mesh))
        server.popen.terminate()
        exit_code = server.popen.wait(timeout=60)
        assert not decoding.done(), "the sequence ended first: its release, not a migration, emptied the server"
        out = decoding.result(timeout=600)
    assert exit_code == 0
    log = server.log_path.read_text()
    assert "drained in" in log and f"deregistered {server.name}" in log  # it left the manager's list at once
    assert out == local.generate([prompt], SamplingParams(max_tokens=100, **params))[0].token_ids
    moved = value(scrape(manager.metrics_address), "infinite_llm:migrations_total") - before
    assert moved >= 1, f"no migration happened (logs: {mesh.log_dir})"
    assert wait_until(lambda: all_blocks_free(mesh), timeout_s=20)


def _lender_holding(mesh: LocalMesh) -> str | None:
    """The server other than compute-0's home (attn-0) that holds the most rBlocks of any sequence, if any."""
    held: dict[str, int] = {}
    for entry in cluster_state(mesh.manager_address).ledger:
        for share in entry.shares:
            if share.server_id != "attn-0" and share.num_blocks > 0:
                held[share.server_id] = held.get(share.server_id, 0) + share.num_blocks
    return max(held, key=held.get) if held else None
