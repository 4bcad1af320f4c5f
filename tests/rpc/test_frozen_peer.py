"""A frozen global manager (SIGSTOP, a VM paused, a stuck node) keeps its connections open and its health
stream silent, so gRPC's client-side health checking would go on counting it SERVING, and round robin would
send it every other call, each timing out, until keepalive gives up on it (30 s + 10 s with the defaults).
A standby takes the lead after the leader's 10 s session lease; members whose heartbeats kept going to the
frozen one were then silent to the new leader, which removed them (a walkthrough saw the prefix index
emptied). Manager channels (``serving_only()``) ping every few seconds and drop a peer that does not answer,
so the frozen one leaves the pick list well within the session lease. Real server processes on loopback.
A busy manager is not dropped: pings are answered by gRPC's threads, not its event loop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc

from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.options import MANAGER_KEEPALIVE_MS, serving_only

MANAGER = """
import asyncio, sys
import grpc
from infinite_llm.pb.v1 import manager_pb2 as mpb, manager_pb2_grpc as mgrpc
from infinite_llm.rpc.server import Service, start_server

class Manager(mgrpc.GlobalManagerServicer):
    async def GetClusterState(self, request, context):
        if sys.argv[1] == "resumed":  # an old leader, resumed: still SERVING a moment, refusing as a standby
            await context.abort(grpc.StatusCode.UNAVAILABLE, "global manager resumed is standing by")
        return mpb.ClusterStateResponse(manager_id=sys.argv[1])

async def main():
    service = Service.of(mpb, "GlobalManager", mgrpc.add_GlobalManagerServicer_to_server, Manager())
    server = await start_server([service], "127.0.0.1:0", tls=None)
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.contextmanager
def _managers(first: str, second: str) -> Iterator[tuple[subprocess.Popen, mgrpc.GlobalManagerStub]]:
    """Two manager processes named ``first`` and ``second``; yields the first's process and a stub over a
    ``serving_only()`` channel whose target lists both, the first first."""
    procs = [
        subprocess.Popen([sys.executable, "-c", MANAGER, n], stdout=subprocess.PIPE, text=True) for n in (first, second)
    ]
    try:
        ports = [int(proc.stdout.readline()) for proc in procs]
        target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)
        with sync_channel(target, tls=None, extra_options=serving_only()) as channel:
            yield procs[0], mgrpc.GlobalManagerStub(channel)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_calls_leave_a_frozen_manager_within_a_few_keepalives_not_after_40_s():
    with _managers("frozen", "live") as (frozen, stub):
        seen = {stub.GetClusterState(mpb.ClusterStateRequest(), timeout=10).manager_id for _ in range(6)}
        assert seen == {"frozen", "live"}  # both SERVING: round robin over both
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        detect_s = sum(MANAGER_KEEPALIVE_MS) / 1000 + 1.0  # a ping, its timeout, and a second's slack
        answers: list[tuple[float, str]] = []
        while (now := time.monotonic()) - stopped < detect_s + 3.0:
            try:
                who = stub.GetClusterState(mpb.ClusterStateRequest(), timeout=1).manager_id
            except grpc.RpcError as e:
                who = e.code().name
            answers.append((now - stopped, who))
        late = [who for at, who in answers if at > detect_s]
        assert len(late) >= 10 and set(late) == {"live"}, answers


def test_a_read_refused_by_a_manager_that_still_reports_serving_is_retried_on_the_leader():
    with _managers("resumed", "live") as (_, stub):
        answers = [stub.GetClusterState(mpb.ClusterStateRequest(), timeout=10).manager_id for _ in range(10)]
        assert answers == ["live"] * 10
