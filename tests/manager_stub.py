"""A stand-in global manager for client-side tests: a real gRPC server on loopback serving a given
``GlobalManager`` servicer, with ``grpc.health.v1`` reporting the manager service SERVING (clients built
with ``serving_only()`` send it calls). The servicer's handlers decide what it answers, or whether it ever
does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.options import MANAGER_SERVICE


@contextlib.contextmanager
def serving_manager(servicer: mgrpc.GlobalManagerServicer, threads: int = 8, serving: bool = True) -> Iterator[int]:
    """Serve ``servicer`` (plaintext, ``threads`` handler threads); yields the port. ``serving=False``: a
    standby's health (alive, the manager service NOT_SERVING). Handlers that block must be released before
    the block ends (``stop`` does not interrupt them)."""
    server = grpc.server(futures.ThreadPoolExecutor(threads))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    mgrpc.add_GlobalManagerServicer_to_server(servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    health_servicer.set(MANAGER_SERVICE, status)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)
