"""Compute instances in the cluster view, on a real mesh (real processes, etcd, model): they register with the
manager, the router follows them as they join, leave, crash and restart, and ``infinite-llm status`` shows
each with its homes, batch, queue, tokens held and debt."""

from __future__ import annotations

import time

from infinite_llm.client import Client
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import BLOCK_SIZE, BLOCKS_PER_SERVER, all_blocks_free, compute_stats, mesh_channel, wait_until

LEASE_S = 3  # the e2e mesh's member TTL


def _listed(mesh) -> dict[str, str]:
    """Compute instances the manager lists: id -> address. (30 s: a model load of a starting instance can
    starve the manager's TLS handshake past the default 5 s on a loaded 2-core CI machine.)"""
    return {c.instance_id: c.address for c in cluster_state(mesh.manager_address, timeout_s=30).compute_instances}


def _generated(address: str) -> int:
    return compute_stats(address).generated_tokens


def _ask(mesh, n: int) -> None:
    """``n`` requests through the router, one after the other, 2 greedy tokens each."""
    with Client(mesh.router_address) as c:
        for _ in range(n):
            assert c.generate("Hello", max_tokens=2, temperature=0, ignore_eos=True).finish_reason == "length"


def _spawn(mesh, name: str, homes: list[str] | None = None):
    proc = mesh.spawn_compute(name, homes)
    assert wait_until(lambda: name in _listed(mesh), timeout_s=180), f"{name} never registered"
    return proc


def test_router_follows_a_compute_instance_that_joins_crashes_and_restarts(mesh):
    first = mesh.compute_instances()[0]
    assert _listed(mesh) == {"compute-0": first.address}
    extra = _spawn(mesh, "compute-extra")
    assert _listed(mesh)["compute-extra"] == extra.address
    # The router re-reads the list every second: the newcomer soon takes requests.
    assert wait_until(lambda: _ask(mesh, 1) or _generated(extra.address) > 0, timeout_s=30)
    # Both idle: turns rotate, 2 requests each, 2 tokens per request.
    before = _generated(first.address), _generated(extra.address)
    _ask(mesh, 4)
    assert (_generated(first.address) - before[0], _generated(extra.address) - before[1]) == (4, 4)

    extra.popen.kill()  # a crash: no deregistration, only the lease expiry removes it
    extra.popen.wait()
    killed_at = time.monotonic()
    _ask(mesh, 2)  # meanwhile requests the router sends there fail over to compute-0 before any token
    assert wait_until(lambda: "compute-extra" not in _listed(mesh), timeout_s=15)
    assert time.monotonic() - killed_at >= 1.0  # by lease expiry, not at once
    before = _generated(first.address)
    time.sleep(2.0)  # the router's next reads of the list
    _ask(mesh, 4)
    assert _generated(first.address) - before == 8  # every request went to compute-0

    restarted = _spawn(mesh, "compute-extra")  # the same id again, at a new port
    assert _listed(mesh) == {"compute-0": first.address, "compute-extra": restarted.address}
    assert wait_until(lambda: _ask(mesh, 1) or _generated(restarted.address) > 0, timeout_s=30)
    restarted.popen.terminate()  # graceful: it deregisters before draining
    stopped_at = time.monotonic()
    assert wait_until(lambda: "compute-extra" not in _listed(mesh), timeout_s=LEASE_S)
    assert time.monotonic() - stopped_at < LEASE_S  # gone before its lease could have lapsed
    restarted.popen.wait(timeout=30)
    _ask(mesh, 2)
    assert wait_until(lambda: all_blocks_free(mesh))


def _compute_states(mesh) -> dict:
    return {c.instance_id: c for c in cluster_state(mesh.manager_address).compute_instances}


def _status_rows(output: str) -> dict[str, list[str]]:
    """The cells of each row of the ``compute instances`` table that ``infinite-llm status`` printed."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines()]
    return {r[0]: r for r in rows if len(r) == 8 and r[0].startswith("compute-")}


def test_status_shows_each_instance_with_homes_batch_queue_tokens_held_and_debt(mesh):
    homed = _spawn(mesh, "compute-homed", homes=["attn-2"])
    try:
        _check_status_of_homed(mesh, homed)
    finally:  # never left behind for the session mesh's next tests, even when a check fails
        homed.popen.terminate()
        homed.popen.wait(timeout=30)
    assert wait_until(lambda: "compute-homed" not in _listed(mesh), timeout_s=LEASE_S)
    assert wait_until(lambda: all_blocks_free(mesh))


def _check_status_of_homed(mesh, homed) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from infinite_llm.cli import app

    # More rBlocks than one server holds; placement is home-first: attn-2, the instance's only home, fills up
    # and the rest is lent by the other servers, so the instance owes those.
    prompt = list(range(1000, 1000 + (BLOCKS_PER_SERVER + 1) * BLOCK_SIZE))
    request = gpb.GenerateRequest(
        request_id="long-homed",
        token_ids=gpb.TokenIds(ids=prompt),
        sampling=gpb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    with mesh_channel(homed.address, "router") as ch:
        call = cgrpc.ComputeInstanceStub(ch).Generate(request, timeout=300)
        try:
            next(call)  # prefilled: every prompt token has KV now
            # A heartbeat taken during the prefill step already counts the sequence running, with no KV yet:
            # wait for one taken after it.
            assert wait_until(lambda: _compute_states(mesh)["compute-homed"].num_tokens_held > 0, timeout_s=10)
            before = cluster_state(mesh.manager_address)
            out = CliRunner().invoke(app, ["status", "--manager", mesh.manager_address], env={"COLUMNS": "250"})
            after = _compute_states(mesh)["compute-homed"]
        finally:
            call.cancel()
    assert out.exit_code == 0, out.output
    (entry,) = [e for e in before.ledger if e.seq_id == "long-homed"]
    home = sum(s.num_blocks for s in entry.shares if s.server_id == "attn-2")
    away = sum(s.num_blocks for s in entry.shares if s.server_id != "attn-2")
    assert entry.instance_id == "compute-homed" and home == BLOCKS_PER_SERVER and away >= 1
    c = {c.instance_id: c for c in before.compute_instances}["compute-homed"]
    assert (list(c.home_server_ids), c.num_running, c.num_waiting, c.debt_blocks) == (["attn-2"], 1, 0, away)
    assert len(prompt) <= c.num_tokens_held <= after.num_tokens_held <= len(prompt) + 200
    row = _status_rows(out.output)["compute-homed"]
    assert row[:6] == ["compute-homed", homed.address, "-", "attn-2", "1", "0"]
    assert c.num_tokens_held <= int(row[6]) <= after.num_tokens_held  # decoding goes on while status runs
    assert away <= int(row[7]) <= after.debt_blocks
    assert _status_rows(out.output)["compute-0"][2:4] == ["-", "attn-0, attn-1, attn-2"]
    assert "long-homed" in out.output and "compute instances" in out.output
