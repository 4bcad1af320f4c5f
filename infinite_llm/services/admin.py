"""Operator views of a running cluster: the manager's cluster state, and the ``infinite-llm status`` table."""

from __future__ import annotations

import grpc
from rich.console import Console
from rich.table import Table

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import sync_channel


def cluster_state(manager_address: str, timeout_s: float = 5.0) -> mpb.ClusterStateResponse:
    """The manager's view: live attention servers with their rBlocks, and the placement ledger."""
    with sync_channel(manager_address) as channel:
        try:
            return mgrpc.GlobalManagerStub(channel).GetClusterState(mpb.ClusterStateRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None


def render_status(state: mpb.ClusterStateResponse, console: Console) -> None:
    """Servers (rBlocks used / free / capacity, sequences) and every sequence's rBlocks per server."""
    servers = Table(title="attention servers")
    for col in ("server", "address", "used", "free", "capacity", "KV used", "sequences"):
        servers.add_column(col, justify="left" if col in ("server", "address") else "right")
    for s in state.servers:
        pct = 100.0 * s.used_blocks / s.capacity_blocks if s.capacity_blocks else 0.0
        servers.add_row(
            s.server_id,
            s.address,
            str(s.used_blocks),
            str(s.free_blocks),
            str(s.capacity_blocks),
            f"{pct:.0f}%",
            str(s.num_sequences),
        )
    total = sum(s.capacity_blocks for s in state.servers)
    used = sum(s.used_blocks for s in state.servers)
    servers.caption = f"cluster: {used}/{total} rBlocks used"
    console.print(servers)
    ledger = Table(title="sequences (rBlocks per server)")
    ledger.add_column("sequence")
    ledger.add_column("rBlocks", justify="right")
    ledger.add_column("placement")
    for e in state.ledger:
        n = sum(s.num_blocks for s in e.shares)
        ledger.add_row(e.seq_id, str(n), ", ".join(f"{s.server_id}: {s.num_blocks}" for s in e.shares))
    console.print(ledger)
