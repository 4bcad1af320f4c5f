"""Backpressure: a compute instance refuses requests past its waiting queue (RESOURCE_EXHAUSTED, HTTP 429,
retryable) instead of queueing without bound; the ones it accepted still complete, and nothing leaks."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from infinite_llm.client import CapacityExhausted, Client
from infinite_llm.mesh import LocalMesh, MeshConfig
from tests.e2e.conftest import BLOCK_SIZE, BYTES_PER_BLOCK, all_blocks_free, wait_until


@pytest.fixture(scope="module")
def busy_mesh(default_model_path):
    config = MeshConfig(
        attention_servers=1,
        kv_memory_bytes=32 * BYTES_PER_BLOCK,
        router_port=0,
        gateway_port=0,
        block_size=BLOCK_SIZE,
        max_num_seqs=1,
        max_waiting=1,
    )
    with LocalMesh(config) as m:
        yield m


def test_requests_past_the_waiting_queue_are_refused_and_retryable(busy_mesh):
    results: dict[str, object] = {}

    def run(name: str) -> None:
        with Client(busy_mesh.router_address) as c:
            try:
                results[name] = c.generate("Tell me a story.", max_tokens=24, temperature=0, ignore_eos=True)
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                results[name] = e

    with Client(busy_mesh.router_address) as client:
        running = client.stream("Tell me a story.", max_tokens=40, temperature=0, ignore_eos=True)
        next(running)  # the only batch slot is taken
        queued = threading.Thread(target=run, args=("queued",))
        queued.start()
        time.sleep(1.0)  # the second request is now the one waiting
        with pytest.raises(CapacityExhausted, match="retry later"):
            client.generate("hi", max_tokens=2)
        r = httpx.post(
            f"http://{busy_mesh.gateway_address}/v1/completions",
            timeout=30,
            json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        rest = list(running)
        assert rest[-1].finish_reason == "length"
        queued.join(timeout=120)
        assert results["queued"].finish_reason == "length" and len(results["queued"].token_ids) == 24
        # the queue drained: the next request is accepted
        assert client.generate("hi", max_tokens=2, temperature=0).finish_reason == "length"
    assert wait_until(lambda: all_blocks_free(busy_mesh))
