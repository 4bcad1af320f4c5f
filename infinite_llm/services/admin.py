"""Operator views of a running cluster: the manager's cluster state, and the ``infinite-llm status`` tables
(attention servers, compute instances with their homes, load and debts, and every sequence's rBlocks)."""

from __future__ import annotations

import grpc
from rich.console import Console
from rich.table import Table

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.options import serving_only
from infinite_llm.rpc.tls import FROM_PROCESS, TlsArg, client_tls

STATE_TIMEOUT_S = 5.0  # how long `status` waits for the manager's answer (seconds)


def cluster_state(
    manager_address: str, timeout_s: float = STATE_TIMEOUT_S, tls: TlsArg = FROM_PROCESS
) -> mpb.ClusterStateResponse:
    """The manager's view: live attention servers with their rBlocks, compute instances, and the ledger.
    ``tls``: as for the SDK (:func:`~infinite_llm.rpc.tls.client_tls`, the ``client`` role by default)."""
    with sync_channel(manager_address, tls=client_tls(tls), extra_options=serving_only()) as channel:
        try:
            return mgrpc.GlobalManagerStub(channel).GetClusterState(mpb.ClusterStateRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None


def render_status(state: mpb.ClusterStateResponse, console: Console) -> None:
    """The leading manager, servers (rBlocks used / free / capacity, cached prefix rBlocks, sequences; a server
    being drained reads ``<id> (draining)``), compute instances (homes, batch, queue, tokens held, debt), every
    sequence's rBlocks per server, the admissions waiting for KV memory and the members the manager refused
    to register lately (each of the last two only if any)."""
    if state.manager_id:
        console.print(f"global manager: {state.manager_id} (leading for {state.leading_for_s:.0f} s)")
    servers = Table(title="attention servers")
    for col in ("server", "address", "node", "used", "free", "capacity", "KV used", "cached", "sequences"):
        servers.add_column(col, justify="left" if col in ("server", "address", "node") else "right")
    for s in state.servers:
        pct = 100.0 * s.used_blocks / s.capacity_blocks if s.capacity_blocks else 0.0
        servers.add_row(
            f"{s.server_id} (draining)" if s.draining else s.server_id,
            s.address,
            s.node_name or "-",
            str(s.used_blocks),
            str(s.free_blocks),
            str(s.capacity_blocks),
            f"{pct:.0f}%",
            str(s.cached_blocks),
            str(s.num_sequences),
        )
    total = sum(s.capacity_blocks for s in state.servers)
    used = sum(s.used_blocks for s in state.servers)
    cached = sum(s.cached_blocks for s in state.servers)
    # cached: rBlocks in the prefix-cache index; those no sequence reads count as free (evicted LRU first)
    servers.caption = f"cluster: {used}/{total} rBlocks used, {cached} cached (shared prefixes)"
    console.print(servers)
    console.print(compute_table(state.compute_instances, {s.server_id for s in state.servers}))
    ledger = Table(title="sequences (rBlocks per server)")
    ledger.add_column("sequence")
    ledger.add_column("instance")
    ledger.add_column("rBlocks", justify="right")
    ledger.add_column("placement")
    for e in state.ledger:
        n = sum(s.num_blocks for s in e.shares)
        placement = ", ".join(f"{s.server_id}: {s.num_blocks}" for s in e.shares)
        ledger.add_row(e.seq_id, e.instance_id or "-", str(n), placement)
    console.print(ledger)
    if state.waiting_admissions:
        console.print(waiting_table(state.waiting_admissions))
    if state.refused:
        console.print(refused_table(state.refused))


def waiting_table(waiting: list[mpb.WaitingAdmission]) -> Table:
    """Requests waiting for KV memory whose admission the manager refused, oldest first: later admissions
    from every compute instance wait behind them (first come, first served across instances)."""
    table = Table(title="waiting admissions", caption="first come, first served across compute instances")
    for col in ("sequence", "instance", "rBlocks", "waiting", "holds later ones"):
        table.add_column(col, justify="right" if col in ("rBlocks", "waiting") else "left", overflow="fold")
    for w in waiting:
        holds = "yes" if w.holding else "no"
        table.add_row(w.seq_id, w.instance_id or "-", str(w.num_blocks), f"{w.waiting_s:.0f} s", holds)
    return table


def refused_table(refused: list[mpb.RefusedRegistration]) -> Table:
    """Members the manager refused to register lately (they keep retrying, NOT_SERVING): who, where, how
    often, and why (what to fix: their model, dtype, block size or id)."""
    table = Table(title="refused registrations (not serving; fix and they join)", title_style="bold red")
    for col in ("kind", "id", "address", "attempts", "last", "reason"):
        table.add_column(col, justify="right" if col in ("attempts", "last") else "left", overflow="fold")
    for r in refused:
        role = "attention server" if r.kind == "attention" else "compute instance" if r.kind == "compute" else r.kind
        table.add_row(role, r.member_id, r.address, str(r.attempts), f"{r.last_refused_ago_s:.0f} s ago", r.reason)
    return table


def compute_table(instances: list[mpb.ComputeInstanceState], live_servers: set[str]) -> Table:
    """One row per compute instance: its homes, batch size (running sequences), queue (waiting), tokens its
    sequences hold, and its debt: rBlocks of its sequences on attention servers that are not its homes.
    A named home that is not among ``live_servers`` (the manager's members: never registered, or its lease
    lapsed) reads ``<id> (down)``."""
    table = Table(title="compute instances")
    for col in ("instance", "address", "node", "homes", "batch", "queue", "tokens held", "debt (rBlocks)"):
        table.add_column(col, justify="left" if col in ("instance", "address", "node", "homes") else "right")
    for c in instances:
        debt = str(c.debt_blocks) if c.HasField("debt_blocks") else "?"
        homes = ", ".join(h if h in live_servers else f"{h} (down)" for h in c.home_server_ids) or "-"
        table.add_row(
            c.instance_id,
            c.address,
            c.node_name or "-",
            homes,
            str(c.num_running),
            str(c.num_waiting),
            str(c.num_tokens_held),
            debt,
        )
    table.caption = f"{len(instances)} compute instances, {sum(c.num_running for c in instances)} sequences running"
    return table
