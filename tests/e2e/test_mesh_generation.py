"""Through the router of a real mesh: greedy output equals the single-process engine and HF transformers,
with KV spread over 3 attention servers; capacity limits; abort and disconnect free everything."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from infinite_llm.client import CapacityExhausted, Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import BLOCK_SIZE, BLOCKS_PER_SERVER, all_blocks_free, wait_until

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()


@pytest.fixture(scope="module")
def client(mesh):
    with Client(mesh.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def local(make_engine):
    return make_engine(num_kv_blocks=512)


def _prompt(tokenizer, n: int) -> list[int]:
    return tokenizer.encode(TEXT)[:n]


@pytest.mark.parametrize("k", [9, 13])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_greedy_through_the_mesh_equals_single_process_and_hf(client, local, hf_model, mesh, k, delta):
    ids = _prompt(local.tokenizer, k * BLOCK_SIZE + delta)
    out = client.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
    ref = local.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text
    hf = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    assert out.token_ids == hf[0, len(ids) :].tolist()
    # the KV could not fit on one server: it was spread
    assert sum(out.placement.values()) == -(-(len(ids) + 12) // BLOCK_SIZE)
    assert len(out.placement) >= 2 and max(out.placement.values()) <= BLOCKS_PER_SERVER
    assert wait_until(lambda: all_blocks_free(mesh))


def test_eight_concurrent_requests_equal_the_single_process_engine(client, local, mesh):
    prompts = [_prompt(local.tokenizer, n) for n in (15, 16, 17, 31, 33, 40, 47, 64)]
    params = dict(max_tokens=10, temperature=0, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: client.generate(p, **params), prompts))
    refs = local.generate(prompts, SamplingParams(**params))
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert wait_until(lambda: all_blocks_free(mesh))


def test_streamed_chunks_add_up_to_the_unary_reply(client):
    chunks = list(client.stream("Tell me about the moon.", max_tokens=16, temperature=0))
    unary = client.generate("Tell me about the moon.", max_tokens=16, temperature=0)
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    last = chunks[-1]
    assert last.finish_reason == unary.finish_reason and last.completion_tokens == len(unary.token_ids)


def test_request_larger_than_the_whole_pool_fails_fast_and_others_still_work(client, local, mesh):
    total_tokens = 3 * BLOCKS_PER_SERVER * BLOCK_SIZE
    t = time.monotonic()
    with pytest.raises(CapacityExhausted, match="rBlocks"):
        client.generate(_prompt(local.tokenizer, total_tokens), max_tokens=8, temperature=0)
    assert time.monotonic() - t < 5
    assert client.generate("Hello", max_tokens=3, temperature=0).finish_reason == "length"
    assert wait_until(lambda: all_blocks_free(mesh))


def test_client_disconnect_mid_stream_frees_every_block_and_the_ledger(client, local, mesh):
    stream = client.stream(_prompt(local.tokenizer, 150), max_tokens=60, temperature=0, ignore_eos=True)
    next(stream)
    next(stream)
    state = cluster_state(mesh.manager_address)
    assert len(state.ledger) == 1 and sum(s.num_blocks for s in state.ledger[0].shares) >= 10
    stream.close()  # the client goes away
    assert wait_until(lambda: all_blocks_free(mesh))
    assert wait_until(lambda: len(cluster_state(mesh.manager_address).ledger) == 0)


def test_abort_by_request_id_frees_every_block(client, local, mesh):
    stream = client.stream(
        _prompt(local.tokenizer, 100), max_tokens=80, temperature=0, ignore_eos=True, request_id="abort-me"
    )
    first = next(stream)
    assert first.request_id == "abort-me"
    assert client.abort("abort-me") is True
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort"
    assert wait_until(lambda: all_blocks_free(mesh))
    assert len(cluster_state(mesh.manager_address).ledger) == 0
    assert client.abort("abort-me") is False
