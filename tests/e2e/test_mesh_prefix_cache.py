"""Cluster-wide prefix caching on a real mesh (issue 13): 2 compute instances, 3 small attention servers, etcd.

A document prefilled by one compute instance is reused by the other where its rBlocks live; greedy output is
identical to the in-process engine without caching: on a hit, for requests sharing a prefix that arrive
together, after the cached blocks were evicted, and after the server holding a shared block died mid-request
(recomputed). Every rBlock is back on the free lists (cached ones parked) and the ledger is empty after each.
"""

from __future__ import annotations

import threading

import pytest

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.mesh import LocalMesh
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    all_blocks_free,
    compute_stats,
    mesh_channel,
    mesh_config,
    wait_until,
)
from tests.e2e.test_mesh_generation import TEXT

BLOCKS_PER_SERVER = 12
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def mesh2(default_model_path):
    config = mesh_config(compute_instances=2, kv_memory_bytes=BLOCKS_PER_SERVER * BYTES_PER_BLOCK)
    with LocalMesh(config) as m:
        m.wait_compute_registered(2)
        yield m


@pytest.fixture(scope="module")
def local(make_engine):
    """The reference: the in-process engine with prefix caching off."""
    return make_engine(num_kv_blocks=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def doc(local) -> list[int]:
    """A 5-block document (80 tokens)."""
    return local.tokenizer.encode(TEXT)[: 5 * BLOCK_SIZE]


def _question(local, text: str) -> list[int]:
    return local.tokenizer.encode(text)


def _reference(local, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return local.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].token_ids


def _generate(address: str, ids: list[int], rid: str, max_tokens: int = MAX_TOKENS) -> list[gpb.GenerateResponse]:
    """Greedy generation on one compute instance directly (as the router calls it)."""
    request = gpb.GenerateRequest(
        request_id=rid,
        token_ids=gpb.TokenIds(ids=ids),
        sampling=gpb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    with mesh_channel(address, "router") as ch:
        return list(cgrpc.ComputeInstanceStub(ch).Generate(request, timeout=300))


def _tokens(replies: list[gpb.GenerateResponse]) -> list[int]:
    return [t for r in replies for t in r.token_ids]


def _cache_stats(address: str) -> tuple[int, int]:
    """``(prefix_cache_queries, prefix_cache_hits)`` of a compute instance, in tokens."""
    s = compute_stats(address)
    return s.prefix_cache_queries, s.prefix_cache_hits


def _settled(mesh: LocalMesh) -> bool:
    return all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger


def test_a_prefix_prefilled_on_one_instance_is_reused_by_the_other_with_identical_output(mesh2, local, doc):
    c0, c1 = (p.address for p in mesh2.compute_instances())
    p1 = doc + _question(local, "\nWhat is this license about?")
    p2 = doc + _question(local, "\nWho may use it?")
    ref1, ref2 = _reference(local, p1), _reference(local, p2)

    before0, before1 = _cache_stats(c0), _cache_stats(c1)
    assert _tokens(_generate(c0, p1, "cold")) == ref1
    assert _cache_stats(c0) == (before0[0] + len(p1), before0[1])  # cold: looked up, nothing served
    assert _tokens(_generate(c1, p2, "warm-other-instance")) == ref2
    assert _cache_stats(c1) == (before1[0] + len(p2), before1[1] + len(doc))  # the document's 5 blocks
    state = cluster_state(mesh2.manager_address)
    # p1's full blocks: its prompt and the generated tokens that filled a block, published by compute-0
    assert sum(s.cached_blocks for s in state.servers) >= (len(p1) + MAX_TOKENS - 1) // BLOCK_SIZE
    assert _tokens(_generate(c1, p1, "warm-same-prompt")) == ref1  # every full prompt block is a hit
    assert _cache_stats(c1)[1] == before1[1] + len(doc) + (len(p1) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert wait_until(lambda: _settled(mesh2))


def test_requests_sharing_a_prefix_that_arrive_together_match_the_reference(mesh2, local, doc):
    c0, c1 = (p.address for p in mesh2.compute_instances())
    shared = list(reversed(doc))  # not cached yet
    prompts = {
        ("a", c0): shared + _question(local, "\nSummarize."),
        ("b", c1): shared + _question(local, "\nTranslate."),
        ("c", c0): shared + _question(local, "\nExplain."),
    }
    refs = {key: _reference(local, ids) for key, ids in prompts.items()}
    got: dict = {}
    barrier = threading.Barrier(len(prompts))

    def run(key, ids):  # noqa: ANN001
        barrier.wait(30)
        got[key] = _tokens(_generate(key[1], ids, f"together-{key[0]}"))

    threads = [threading.Thread(target=run, args=(k, ids)) for k, ids in prompts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == refs
    assert wait_until(lambda: _settled(mesh2))


def test_output_is_identical_after_the_cached_blocks_were_evicted(mesh2, local, doc):
    c0, c1 = (p.address for p in mesh2.compute_instances())
    p1 = doc + _question(local, "\nWhat is this license about?")
    _generate(c0, p1, "warm-up")
    # A prompt as large as the cluster's free memory allows: placing it evicts parked cached rBlocks (least
    # recently used first) before it could fail for lack of space.
    filler = local.tokenizer.encode(TEXT)[1000 : 1000 + (3 * BLOCKS_PER_SERVER - 1) * BLOCK_SIZE - MAX_TOKENS]
    assert len(_tokens(_generate(c1, filler, "filler"))) == MAX_TOKENS
    before = _cache_stats(c1)
    assert _tokens(_generate(c1, p1, "after-eviction")) == _reference(local, p1)
    assert _cache_stats(c1)[1] - before[1] < len(doc)  # the document's first blocks were evicted: recomputed
    assert wait_until(lambda: _settled(mesh2))


@pytest.mark.step_recoveries  # it stops an attention server mid-step
def test_losing_the_server_of_a_shared_block_mid_request_recomputes_with_identical_output(mesh2, local, doc):
    c0, c1 = (p.address for p in mesh2.compute_instances())
    p1 = doc + _question(local, "\nWho wrote it?")
    ref = _reference(local, p1, max_tokens=40)
    _generate(c0, p1[: len(doc) + 1], "writer", max_tokens=1)  # caches the document's 5 blocks
    by_name = {p.name: p for p in mesh2.attention_servers()}
    request = gpb.GenerateRequest(
        request_id="reader",
        token_ids=gpb.TokenIds(ids=p1),
        sampling=gpb.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    )
    hits, chunks = _cache_stats(c1)[1], []
    with mesh_channel(c1, "router") as ch:
        for reply in cgrpc.ComputeInstanceStub(ch).Generate(request, timeout=300):
            chunks.append(reply)
            if len(chunks) == 3:
                assert _cache_stats(c1)[1] - hits == len(doc)  # the reader attached the document's blocks
                (entry,) = [e for e in cluster_state(mesh2.manager_address).ledger if e.seq_id == "reader"]
                victim = entry.shares[0].server_id  # holds the reader's block 0: a shared, cached rBlock
                by_name[victim].popen.kill()
    assert _tokens(chunks) == ref
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_preemptions >= 1
    assert victim not in {p.server_id for p in chunks[-1].placement}
    live = lambda: {s.server_id for s in cluster_state(mesh2.manager_address).servers}  # noqa: E731
    assert wait_until(lambda: victim not in live(), timeout_s=15)  # its lease expired: its entries left the index
    mesh2.respawn(by_name[victim])
    mesh2.wait_registered(3, timeout_s=60)
    assert wait_until(lambda: _settled(mesh2), timeout_s=30)
    servers = cluster_state(mesh2.manager_address).servers
    assert [s.cached_blocks for s in servers if s.server_id == victim] == [0]  # it rejoined empty
