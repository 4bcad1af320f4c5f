"""Live migration on a real mesh: a long sequence's rBlocks move between 3 attention servers while it decodes
(spread onto servers added after start, brought home when its home frees), and its greedy output equals the
single-process engine's; the manager counts the migrations and nothing stays held afterwards."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from infinite_llm.client import Client
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.mesh import LocalMesh
from tests.e2e.conftest import all_blocks_free, mesh_config, wait_until
from tests.e2e.test_observability import scrape, value

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()


@pytest.fixture(scope="module")
def home_mesh(default_model_path):
    """compute-0 with one home server (attn-0, 8 rBlocks); attn-1 and attn-2 join after start, nobody's home."""
    with LocalMesh(mesh_config(attention_servers=1, compute_instances=1)) as m:
        m.spawn_attention("attn-1")
        m.spawn_attention("attn-2")
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
    refs = local.generate([short, long_], SamplingParams(max_tokens=20, **params))[:1] + local.generate(
        [long_], SamplingParams(max_tokens=180, **params)
    )
    assert out_short.token_ids == refs[0].token_ids
    assert out_long.token_ids == refs[1].token_ids
    assert len(out_long.placement) >= 2  # its KV spanned servers
    moved = value(scrape(manager.metrics_address), "infinite_llm:migrations_total") - before
    assert moved >= 1, f"no migration happened (logs: {mesh.log_dir})"
    assert wait_until(lambda: all_blocks_free(mesh), timeout_s=20)
