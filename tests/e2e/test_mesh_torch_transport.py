"""The local mesh with ``transport="torch"``: attention tensors on gloo tensor channels (gRPC keeps the
control), greedy output equal to the single-process engine, KV spread over all 3 attention servers."""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.mesh import LocalMesh
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import BLOCK_SIZE, BLOCKS_PER_SERVER, all_blocks_free, mesh_config, wait_until

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def torch_mesh(default_model_path):
    with LocalMesh(mesh_config(transport="torch")) as m:
        yield m


@pytest.fixture(scope="module")
def client(torch_mesh):
    with Client(torch_mesh.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def local(make_engine):
    return make_engine(num_kv_blocks=512)


def _log(mesh: LocalMesh, name: str) -> str:
    return (mesh.log_dir / f"{name}.log").read_text(encoding="utf-8")


@pytest.mark.parametrize("num_tokens", [13 * BLOCK_SIZE + 1, 20 * BLOCK_SIZE])  # 2 servers, then all 3
def test_greedy_over_tensor_channels_equals_the_single_process_engine(client, local, torch_mesh, num_tokens):
    ids = local.tokenizer.encode(TEXT)[:num_tokens]
    out = client.generate(ids, **GREEDY)
    ref = local.generate([ids], SamplingParams(**GREEDY))[0]
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert sum(out.placement.values()) == -(-(num_tokens + 8) // BLOCK_SIZE)
    assert len(out.placement) >= (3 if num_tokens > 2 * BLOCKS_PER_SERVER * BLOCK_SIZE else 2)
    assert wait_until(lambda: all_blocks_free(torch_mesh))


def test_concurrent_requests_over_tensor_channels_equal_the_single_process_engine(client, local, torch_mesh):
    prompts = [local.tokenizer.encode(TEXT)[:n] for n in (15, 17, 33)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: client.generate(p, **GREEDY), prompts))
    refs = local.generate(prompts, SamplingParams(**GREEDY))
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert wait_until(lambda: all_blocks_free(torch_mesh))


def test_every_pair_formed_a_tensor_channel_and_none_fell_back(client, torch_mesh):
    client.generate("Hello", max_tokens=2, temperature=0)  # a step on at least one server
    compute = _log(torch_mesh, "compute-0")
    assert "tensor channel" in compute and "tensors travel over gRPC" not in compute
    opened = [p.name for p in torch_mesh.attention_servers() if "tensor channel" in _log(torch_mesh, p.name)]
    assert opened == ["attn-0", "attn-1", "attn-2"]  # the earlier tests placed rBlocks on each of them
    # every step so far was good: each pair's channel formed once and was never closed under a step
    assert len(re.findall(r": tensor channel \S+ open \(gloo\)", compute)) == 3


def test_client_disconnect_mid_stream_frees_every_block_over_tensor_channels(client, local, torch_mesh):
    ids = local.tokenizer.encode(TEXT)[:150]
    stream = client.stream(ids, max_tokens=60, temperature=0, ignore_eos=True)
    next(stream)
    next(stream)
    assert sum(s.num_blocks for e in cluster_state(torch_mesh.manager_address).ledger for s in e.shares) >= 10
    stream.close()  # the client goes away mid-decode
    assert wait_until(lambda: all_blocks_free(torch_mesh))
    assert wait_until(lambda: len(cluster_state(torch_mesh.manager_address).ledger) == 0)
    assert (
        client.generate(ids[:20], **GREEDY).token_ids
        == local.generate([ids[:20]], SamplingParams(**GREEDY))[0].token_ids
    )


@pytest.mark.step_recoveries  # it stops an attention server mid-step
def test_killed_attention_server_mid_stream_over_tensor_channels_gives_identical_greedy_output(
    client, local, torch_mesh
):
    """Last in the module: it leaves the mesh with 2 attention servers."""
    ids = local.tokenizer.encode(TEXT)[:150]  # 150 + 40 tokens: 12 rBlocks, more than one server's 8
    ref = local.generate([ids], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    by_name = {p.name: p for p in torch_mesh.attention_servers()}
    chunks = []
    for chunk in client.stream(ids, max_tokens=40, temperature=0, ignore_eos=True, timeout=300):
        chunks.append(chunk)
        if len(chunks) == 5:
            (entry,) = cluster_state(torch_mesh.manager_address).ledger
            victim = max(entry.shares, key=lambda s: s.num_blocks).server_id
            by_name[victim].popen.kill()  # its rBlocks and its end of the tensor channel die with it
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_preemptions >= 1
    assert victim not in chunks[-1].placement
    assert wait_until(lambda: all_blocks_free(torch_mesh))
