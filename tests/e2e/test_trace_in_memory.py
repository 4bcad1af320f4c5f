"""One trace id across gateway, router, compute, attention servers and manager, seen by an in-memory exporter.

Every service runs in this process (real gRPC servers on loopback, a real etcd, the real model, the gateway's
real ASGI app) so that one ``InMemorySpanExporter`` sees every hop. The processes of the local mesh are
traced the same way; ``test_observability.py`` checks that across real processes with the ``jsonl`` exporter.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.instrumentation.grpc import (
    GrpcAioInstrumentorClient,
    GrpcAioInstrumentorServer,
    GrpcInstrumentorClient,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infinite_llm.rpc.tls import TLS_DIR_ENV
from tests.e2e.conftest import BLOCK_SIZE, BYTES_PER_BLOCK


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # this process sets it nowhere else (services trace in subprocesses)
    instrumentors = [GrpcAioInstrumentorServer(), GrpcAioInstrumentorClient(), GrpcInstrumentorClient()]
    for i in instrumentors:
        i.instrument(tracer_provider=provider)
    yield exporter
    for i in instrumentors:
        i.uninstrument()


async def _serve_everything(default_weights, tmp_path):
    """Start etcd + every service in-process; returns (gateway ASGI app, things to stop)."""
    from infinite_llm.pb.v1 import (
        compute_instance_pb2,
        compute_instance_pb2_grpc,
        manager_pb2,
        manager_pb2_grpc,
        router_pb2,
        router_pb2_grpc,
    )
    from infinite_llm.rpc.server import Service, start_server
    from infinite_llm.services.attention.registrar import Registrar
    from infinite_llm.services.attention.server import AttentionServerConfig, start
    from infinite_llm.services.compute.engine_loop import EngineLoop
    from infinite_llm.services.compute.remote_kv import remote_dist_attention
    from infinite_llm.services.compute.servicer import ComputeInstanceServicer
    from infinite_llm.services.gateway.app import create_app
    from infinite_llm.services.gateway.backend import RouterBackend
    from infinite_llm.services.manager.grpc_servers import GrpcBlockServers
    from infinite_llm.services.manager.manager import GlobalManager, ManagerConfig
    from infinite_llm.services.manager.servicer import GlobalManagerServicer
    from infinite_llm.services.router.servicer import RouterServicer
    from infinite_llm.state.etcd_launcher import start_etcd
    from infinite_llm.state.etcd_store import EtcdStore

    model_config, state_dict, tokenizer = default_weights
    stop = []
    etcd = start_etcd(data_dir=tmp_path / "etcd")
    stop.append(etcd.stop)
    store = EtcdStore(etcd.host, etcd.client_port)
    await store.connect()
    holder = []
    manager = GlobalManager(
        store, GrpcBlockServers(lambda s: holder[0].address_of(s)), ManagerConfig("m0", block_size=BLOCK_SIZE)
    )
    await manager.start(acquire_timeout_s=30)
    holder.append(GlobalManagerServicer(manager))
    manager_rpc = await start_server(
        [Service.of(manager_pb2, "GlobalManager", manager_pb2_grpc.add_GlobalManagerServicer_to_server, holder[0])]
    )
    manager_address = f"127.0.0.1:{manager_rpc.port}"
    for i in range(2):
        server = await start(
            AttentionServerConfig.for_model(
                model_config, server_id=f"attn-{i}", kv_memory_bytes=8 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE
            )
        )
        registrar = Registrar(manager_address, f"attn-{i}", server.address, BLOCK_SIZE, server.servicer.holder.stats)
        registrar.start()
        await asyncio.wait_for(registrar.registered.wait(), 30)
        stop += [registrar.stop, server.stop]
    from infinite_llm.engine import EngineConfig, LLMEngine

    kv = remote_dist_attention(manager_address, BLOCK_SIZE)
    engine = LLMEngine.from_weights(model_config, state_dict, tokenizer, EngineConfig(block_size=BLOCK_SIZE), kv=kv)
    loop = EngineLoop(engine)
    loop.start()
    compute = ComputeInstanceServicer(loop, "compute-0", "SmolLM2-135M-Instruct", kv=kv)
    compute_rpc = await start_server(
        [
            Service.of(
                compute_instance_pb2,
                "ComputeInstance",
                compute_instance_pb2_grpc.add_ComputeInstanceServicer_to_server,
                compute,
            )
        ]
    )
    router = RouterServicer(
        [f"127.0.0.1:{compute_rpc.port}"], "SmolLM2-135M-Instruct", model_config.max_position_embeddings, tokenizer
    )
    router_rpc = await start_server(
        [Service.of(router_pb2, "Router", router_pb2_grpc.add_RouterServicer_to_server, router)]
    )
    app = create_app(RouterBackend(f"127.0.0.1:{router_rpc.port}", tokenizer))
    FastAPIInstrumentor.instrument_app(app, tracer_provider=trace.get_tracer_provider())
    # stopped in reverse: gateway side first, the store last
    stop += [store.close, manager.stop, manager_rpc.stop, loop.stop, compute_rpc.stop, router_rpc.stop]
    return app, stop


def test_one_trace_id_across_every_hop_in_memory(exporter, default_weights, tmp_path, monkeypatch):
    # Every service here runs in this process and in plaintext: the e2e session's INFINITE_LLM_TLS_DIR
    # would make the gateway dial the router over TLS.
    monkeypatch.delenv(TLS_DIR_ENV, raising=False)

    async def scenario():
        app, stop = await _serve_everything(default_weights, tmp_path)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                r = await http.post(
                    "/v1/completions",
                    json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
                    timeout=120,
                )
            assert r.status_code == 200, r.text
        finally:
            for fn in reversed(stop):
                result = fn()
                if asyncio.iscoroutine(result):
                    await result

    asyncio.run(scenario())
    spans = exporter.get_finished_spans()
    gateway = [s for s in spans if s.name.startswith("POST /v1/completions") and s.kind == trace.SpanKind.SERVER]
    assert len(gateway) == 1
    trace_id = gateway[0].context.trace_id
    names = {s.name for s in spans if s.context.trace_id == trace_id and s.kind == trace.SpanKind.SERVER}
    names |= {s.name for s in spans if s.context.trace_id == trace_id and s.name == "engine.step"}
    hops = (
        "/infinite_llm.v1.Router/Generate",
        "/infinite_llm.v1.ComputeInstance/Generate",
        "engine.step",
        "/infinite_llm.v1.AttentionServer/AttendStream",
        "/infinite_llm.v1.GlobalManager/Place",
    )
    for hop in hops:  # the router's hop is Generate or GenerateStream
        assert any(n.startswith(hop) for n in names), (hop, sorted(names))
