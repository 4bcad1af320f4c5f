"""Prometheus metrics of every service move by the expected amounts; one trace spans every hop."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from infinite_llm.client import Client
from infinite_llm.mesh import LocalMesh, MeshConfig
from tests.e2e.conftest import BLOCK_SIZE, BYTES_PER_BLOCK, wait_until


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a /metrics page."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_of_every_service_move_by_the_expected_amounts(mesh):
    compute = mesh.compute_instances()[0]
    router = mesh._by_role("router")[0]
    manager = mesh._by_role("manager")[0]
    before = {p.name: scrape(p.metrics_address) for p in (compute, router, manager)}
    with Client(mesh.router_address) as client:
        outs = [client.generate("Count to five:", max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5)]
    tokens = sum(len(o.token_ids) for o in outs)
    prompt = sum(o.prompt_tokens for o in outs)
    assert tokens == 8
    after_compute = scrape(compute.metrics_address)

    def delta(name: str, after: dict, **labels) -> float:
        return value(after, name, **labels) - value(before[compute.name], name, **labels)

    assert delta("infinite_llm:generation_tokens_total", after_compute) == tokens
    assert delta("infinite_llm:prompt_tokens_total", after_compute) == prompt
    assert delta("infinite_llm:request_success_total", after_compute, finished_reason="length") == 2
    assert delta("infinite_llm:time_to_first_token_seconds_count", after_compute) == 2
    assert delta("infinite_llm:inter_token_latency_seconds_count", after_compute) == tokens - 2
    assert delta("infinite_llm:e2e_request_latency_seconds_count", after_compute) == 2
    assert delta("infinite_llm:request_queue_time_seconds_count", after_compute) == 2
    # each request alone: one prefill step gives its first token, one decode step each further token
    assert delta("infinite_llm:engine_step_seconds_count", after_compute) == tokens
    assert value(after_compute, "infinite_llm:num_requests_running") == 0
    rpc_calls = sum(v for (n, _), v in after_compute.items() if n == "infinite_llm:attention_rpc_latency_seconds_count")
    assert rpc_calls >= 30 * 8  # every layer of every step called at least one attention server

    after_router = scrape(router.metrics_address)
    assert (
        value(after_router, "infinite_llm:router_generation_tokens_total")
        - value(before[router.name], "infinite_llm:router_generation_tokens_total")
        == tokens
    )
    assert (
        value(after_router, "infinite_llm:router_requests_total", status="ok")
        - value(before[router.name], "infinite_llm:router_requests_total", status="ok")
        == 2
    )

    after_manager = scrape(manager.metrics_address)
    placements = value(after_manager, "infinite_llm:placements_total") - value(
        before[manager.name], "infinite_llm:placements_total"
    )
    assert placements >= 2  # at least one placement per request
    assert (
        value(after_manager, "infinite_llm:releases_total") - value(before[manager.name], "infinite_llm:releases_total")
        == 2
    )

    for server in [s for s in mesh.attention_servers() if s.alive()]:  # not ones a test killed
        samples = scrape(server.metrics_address)
        labels = {"server_id": server.name}
        assert wait_until(
            lambda s=server, lb=labels: value(scrape(s.metrics_address), "infinite_llm:rblocks_used", **lb) == 0
        )
        assert (
            value(samples, "infinite_llm:rblocks_free", **labels)
            + value(samples, "infinite_llm:rblocks_used", **labels)
            == 8
        )

    # The pool's KV usage (vLLM's kv_cache_usage_perc, over every live server): above 0 while a request
    # holds rBlocks, back to 0 once none does.
    def usage() -> float:
        return value(scrape(manager.metrics_address), "infinite_llm:kv_cache_usage_perc")

    assert wait_until(lambda: usage() == 0)
    assert value(scrape(manager.metrics_address), "infinite_llm:manager_is_leader") == 1  # the only manager leads
    with Client(mesh.router_address) as client:
        stream = client.stream("Count to fifty:", max_tokens=40, temperature=0, ignore_eos=True)
        next(stream)
        held = usage()
        stream.close()
    assert 0 < held <= 1
    assert wait_until(lambda: usage() == 0)

    gw_before = value(
        scrape(mesh.gateway_address), "infinite_llm:gateway_requests_total", route="/v1/models", status="200"
    )
    with urllib.request.urlopen(f"http://{mesh.gateway_address}/v1/models", timeout=10) as reply:
        assert reply.status == 200
    gw_after = value(
        scrape(mesh.gateway_address), "infinite_llm:gateway_requests_total", route="/v1/models", status="200"
    )
    assert gw_after - gw_before == 1
    template = "/v1/models/{model_id:path}"
    missing_before = value(
        scrape(mesh.gateway_address), "infinite_llm:gateway_requests_total", route=template, status="404"
    )  # other tests of this session may have asked for an unknown model already
    for model_id in ("nope-1", "nope-2"):  # a path parameter is not a label: the route's template is
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://{mesh.gateway_address}/v1/models/{model_id}", timeout=10)
        assert error.value.code == 404
    samples = scrape(mesh.gateway_address)
    missing_after = value(samples, "infinite_llm:gateway_requests_total", route=template, status="404")
    assert missing_after - missing_before == 2
    assert not [labels for _, labels in samples if any("nope" in v for _, v in labels)]


@pytest.fixture(scope="module")
def traced_mesh(default_model_path, tmp_path_factory):
    spans = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_TRACES_EXPORTER", "jsonl")
        mp.setenv("INFINITE_LLM_SPANS_PATH", str(spans))
        config = MeshConfig(
            attention_servers=2,
            kv_memory_bytes=16 * BYTES_PER_BLOCK,
            router_port=0,
            gateway_port=0,
            block_size=BLOCK_SIZE,
        )
        with LocalMesh(config) as m:
            yield m, spans


def test_one_trace_follows_a_request_through_every_hop(traced_mesh):
    mesh, spans_path = traced_mesh
    import openai

    client = openai.OpenAI(base_url=f"http://{mesh.gateway_address}/v1", api_key="unused")
    raw = client.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", prompt="Hello there", max_tokens=4, temperature=0
    )
    done = raw.parse()
    assert done.choices[0].finish_reason == "length"
    assert raw.headers["x-request-id"] == done.id  # what to grep the logs and traces for
    # Five processes export their spans as they end, the last hops' a moment after the reply: read again until
    # the request's trace is whole, or 15 s passed (then the asserts say what is missing). A line still being
    # written is read at the next try.
    hops = {"gateway", "router", "compute", "attention", "manager"}
    expected = {("gateway", done.id), ("router", f"{done.id}-0"), ("compute", f"{done.id}-0")}
    deadline = time.monotonic() + 15
    while True:
        spans = []
        for line in spans_path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        gateway_traces = {s["trace_id"] for s in spans if s["service"] == "gateway" and s["kind"] == "SERVER"}
        by_trace: dict[str, set[str]] = {}
        for s in spans:
            by_trace.setdefault(s["trace_id"], set()).add(s["service"])
        full = [t for t in gateway_traces if hops <= by_trace[t]]
        ours = [s for s in spans if full and s["trace_id"] == full[0]]
        names = {s["name"] for s in ours}
        # the completion's id names its spans: the gateway's request, the router's relay of its choice, the
        # compute instance's generation (one choice: "<id>-0")
        named = {(s["service"], s["request_id"]) for s in ours if s["request_id"]}
        if (len(full) == 1 and "engine.step" in names and named == expected) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(full) == 1, {t: by_trace[t] for t in gateway_traces}
    assert "engine.step" in names
    assert named == expected, named
    assert any("AttendStream" in n for n in names) and any("Place" in n for n in names)
