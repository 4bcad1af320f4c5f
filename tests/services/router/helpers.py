"""A manager over real etcd served on loopback, a router following it, and model-free compute instances.

The compute instances are real gRPC servers that answer every Generate with their own name as the text, and
register through the real :class:`ComputeRegistrar`: what the router and the manager see is the real thing,
only the dense layers are missing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.server import RpcServer, Service, start_server
from infinite_llm.services.compute.registrar import ComputeLoadReport, ComputeRegistrar
from infinite_llm.services.manager import GlobalManager
from infinite_llm.services.manager.servicer import GlobalManagerServicer
from infinite_llm.services.router.discovery import ComputeDiscovery
from infinite_llm.services.router.servicer import RouterServicer
from tests.services.manager.helpers import make_servers, running_manager


class NamedCompute(cgrpc.ComputeInstanceServicer):
    """Answers each Generate with one message whose text is this instance's name; remembers the requests."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[str] = []

    async def Generate(self, request: gpb.GenerateRequest, context):  # noqa: N802, ANN001
        self.requests.append(request.request_id)
        yield gpb.GenerateResponse(request_id=request.request_id, text=self.name, finish_reason="stop")


@dataclass
class ComputeProc:
    servicer: NamedCompute
    server: RpcServer
    registrar: ComputeRegistrar

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def crash(self) -> None:
        """Stop heartbeating and serving without deregistering: the lease lapses after its TTL."""
        await self.registrar.stop(deregister=False)
        await self.server.stop(0)


@contextlib.asynccontextmanager
async def compute_instance(manager_address: str, name: str, load: ComputeLoadReport | None = None, homes=()):
    """A registered model-free compute instance on a free port; deregisters and stops on exit. Its heartbeats
    report ``load`` (default: idle)."""
    load = load or ComputeLoadReport(0, 0, 0)
    servicer = NamedCompute(name)
    service = Service.of(cpb, "ComputeInstance", cgrpc.add_ComputeInstanceServicer_to_server, servicer)
    server = await start_server([service], "127.0.0.1:0")
    registrar = ComputeRegistrar(manager_address, name, f"127.0.0.1:{server.port}", lambda: load, homes)
    registrar.start()
    proc = ComputeProc(servicer, server, registrar)
    try:
        await registrar.registered.wait()
        yield proc
    finally:
        await registrar.stop()
        await server.stop(0)


@dataclass
class Cluster:
    manager: GlobalManager
    manager_server: RpcServer
    manager_address: str
    router: RouterServicer
    router_address: str
    discovery: ComputeDiscovery

    def router_stub(self) -> rgrpc.RouterStub:
        return rgrpc.RouterStub(aio_channel(self.router_address))

    def manager_stub(self) -> mgrpc.GlobalManagerStub:
        return mgrpc.GlobalManagerStub(aio_channel(self.manager_address))

    def routed(self) -> list[str]:
        """The router's instances for new requests, by id."""
        return sorted(i.instance_id for i in self.router.instances)


@contextlib.asynccontextmanager
async def cluster(etcd, prefix, ttl_s: int = 2, static: tuple[str, ...] = (), interval_s: float = 0.2):
    """A leading manager (lease TTL ``ttl_s`` s) served over gRPC, and a router polling it every ``interval_s``."""
    async with running_manager(etcd, prefix, make_servers({"a": 4}), member_ttl_s=ttl_s) as manager:
        servicer = GlobalManagerServicer(manager)
        manager_service = Service.of(mpb, "GlobalManager", mgrpc.add_GlobalManagerServicer_to_server, servicer)
        manager_server = await start_server([manager_service], "127.0.0.1:0")
        manager_address = f"127.0.0.1:{manager_server.port}"
        router = RouterServicer(list(static), "tiny", 2048, tokenizer=None)
        router_server = await start_server(
            [Service.of(rpb, "Router", rgrpc.add_RouterServicer_to_server, router)], "127.0.0.1:0"
        )
        discovery = ComputeDiscovery(manager_address, router.set_discovered, interval_s)
        await discovery.refresh()
        discovery.start()
        try:
            router_address = f"127.0.0.1:{router_server.port}"
            yield Cluster(manager, manager_server, manager_address, router, router_address, discovery)
        finally:
            await discovery.stop()
            await router_server.stop(0)
            await manager_server.stop(0)


async def ask(stub: rgrpc.RouterStub) -> str:
    """One Generate through the router; the name of the compute instance that answered."""
    request = gpb.GenerateRequest(text="hello", sampling=gpb.SamplingParams(max_tokens=1))
    return (await stub.Generate(request, timeout=10)).text
