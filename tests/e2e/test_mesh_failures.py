"""Failure model (DESIGN.md §6): an attention server dies mid-request; its rBlocks are lost, the request is
re-placed and recomputed from its tokens on the surviving servers, and the greedy output is unchanged."""

from __future__ import annotations

import pytest

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.mesh import LocalMesh, MeshConfig
from tests.e2e.conftest import BLOCK_SIZE, BYTES_PER_BLOCK, RECOVERIES, all_blocks_free, wait_until
from tests.e2e.test_mesh_generation import TEXT
from tests.e2e.test_observability import scrape, value


@pytest.fixture(scope="module")
def small_mesh(default_model_path):
    config = MeshConfig(
        attention_servers=3,
        kv_memory_bytes=8 * BYTES_PER_BLOCK,
        router_port=0,
        gateway_port=0,
        block_size=BLOCK_SIZE,
        member_ttl_s=3,
    )
    with LocalMesh(config) as m:
        yield m


@pytest.mark.step_recoveries  # it stops an attention server mid-step
def test_killed_attention_server_mid_stream_gives_identical_greedy_output(small_mesh, make_engine):
    local = make_engine(num_kv_blocks=256)
    ids = local.tokenizer.encode(TEXT)[:150]  # 150 + 40 tokens: 12 rBlocks, more than one server's 8
    ref = local.generate([ids], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    by_name = {p.name: p for p in small_mesh.attention_servers()}
    (compute,) = small_mesh.compute_instances()
    recoveries = value(scrape(compute.metrics_address), RECOVERIES)
    with Client(small_mesh.router_address) as client:
        chunks = []
        stream = client.stream(ids, max_tokens=40, temperature=0, ignore_eos=True, timeout=300)
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                from infinite_llm.services.admin import cluster_state

                (entry,) = cluster_state(small_mesh.manager_address).ledger
                victim = max(entry.shares, key=lambda s: s.num_blocks).server_id
                by_name[victim].popen.kill()  # its rBlocks die with it
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == ref.token_ids
        assert chunks[-1].finish_reason == "length"
        assert victim not in chunks[-1].placement  # the tail of the request lived on the survivors
        assert chunks[-1].num_preemptions >= 1
        assert value(scrape(compute.metrics_address), RECOVERIES) >= recoveries + 1
        # the mesh keeps serving, and the survivors got every block back
        assert client.generate("Hello", max_tokens=3, temperature=0).finish_reason == "length"
    assert wait_until(lambda: all_blocks_free(small_mesh))
