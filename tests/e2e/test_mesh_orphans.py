"""Faults under load leave no orphans (issue 11): after a compute instance SIGKILL, a leading manager SIGKILL
(its hot standby takes the lead; it comes back as the standby), an etcd restart, and an attention server
paused past its lease, the ledger is empty and every rBlock is free again within one lease period of the
requests ending; requests that outlive a manager failover, an etcd outage or a paused server finish with the
undisturbed greedy output; a router told to stop (SIGTERM) refuses new requests and lets those in flight
finish. Each test prints its figures."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import threading
import time
from collections.abc import Callable

import pytest

from infinite_llm.client import Client
from infinite_llm.client.errors import Unavailable
from infinite_llm.mesh import LocalMesh, health_check
from infinite_llm.services.admin import cluster_state
from infinite_llm.services.manager.server import EXIT_LOST_LEADERSHIP
from infinite_llm.state.etcd_launcher import start_etcd
from tests.e2e.conftest import all_blocks_free, mesh_config, wait_until
from tests.e2e.test_mesh_generation import TEXT

TTL_S = 5  # member lease (seconds): short, so lease expiry is quick to test; not so short that a busy CI
# machine (2 cores, TLS handshakes, a model loading beside) misses heartbeats
PROMPTS = [TEXT[:300], TEXT[300:600]]  # ~60 tokens each
GREEDY = dict(temperature=0, ignore_eos=True)
# A manager's log lines saying it lost a member: removed as silent, its key gone, its cached prefixes dropped.
MEMBER_LOST = re.compile(
    r"(attention server|compute instance) \S+ gone$|not heard from|dropped \d+ cached rBlocks", re.M
)


@pytest.fixture(scope="module")
def fault_mesh(default_model_path):
    with LocalMesh(mesh_config(member_ttl_s=TTL_S, standby_managers=1)) as m:  # clients dial both managers
        yield m


def ledger(mesh: LocalMesh) -> dict[str, list[tuple[str, int]]]:
    state = cluster_state(mesh.manager_address)
    return {e.seq_id: [(s.server_id, s.num_blocks) for s in e.shares] for e in state.ledger}


def no_orphans(mesh: LocalMesh) -> bool:
    """No ledger entry, and every live attention server's rBlocks free (no request runs)."""
    try:
        return not ledger(mesh) and all_blocks_free(mesh)
    except Exception:  # noqa: BLE001 - the manager may be restarting
        return False


class Streams:
    """Greedy streams in threads, each recording its tokens and how it ended."""

    def __init__(self, mesh: LocalMesh, prompts: list[str] | list[list[int]], max_tokens: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[Exception | None] = [None] * len(prompts)
        self.threads = [
            threading.Thread(target=self._run, args=(mesh.router_address, i, p, max_tokens), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, router: str, i: int, prompt: str | list[int], max_tokens: int) -> None:
        try:
            with Client(router) as client:
                for chunk in client.stream(prompt, max_tokens=max_tokens, timeout=240, **GREEDY):
                    self.tokens[i].extend(chunk.token_ids)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            self.errors[i] = e

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        assert wait_until(lambda: all(len(t) >= n for t in self.tokens), timeout_s), (self.tokens, self.errors)

    def join(self, timeout_s: float = 240) -> None:
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"


REFERENCE_TOKENS = 48  # the longest reference a test compares with


@pytest.fixture(scope="module")
def references(fault_mesh) -> Callable[[int], list[list[int]]]:
    """``references(max_tokens)``: the undisturbed greedy output of each prompt (non-streamed), ``max_tokens``
    of it. Generated once, when the first test asks (the mesh healthy): greedy decoding with ``ignore_eos``
    makes ``n`` tokens the first ``n`` of any longer output, so the tests share one generation (~14 s on
    2 cores, the prompts decoding together as the tests' streams do)."""
    with Client(fault_mesh.router_address) as client, concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        full = list(pool.map(lambda p: client.generate(p, max_tokens=REFERENCE_TOKENS, **GREEDY).token_ids, PROMPTS))

    def first(max_tokens: int) -> list[list[int]]:
        assert max_tokens <= REFERENCE_TOKENS
        return [ref[:max_tokens] for ref in full]

    return first


def seconds_to_clean(mesh: LocalMesh, timeout_s: float) -> float:
    start = time.monotonic()
    assert wait_until(lambda: no_orphans(mesh), timeout_s), (ledger(mesh), "rBlocks or ledger entries leaked")
    return time.monotonic() - start


def test_compute_instance_killed_mid_decode_leaves_no_orphans_and_is_replaced(fault_mesh):
    mesh = fault_mesh
    streams = Streams(mesh, PROMPTS, max_tokens=200)
    streams.wait_tokens(3)
    assert len(ledger(mesh)) == 2
    (compute,) = mesh.compute_instances()
    compute.popen.kill()
    killed_at = time.monotonic()
    streams.join(60)
    assert all(isinstance(e, Unavailable) for e in streams.errors), streams.errors  # failed after tokens, not hung
    for e in streams.errors:  # saying what happened and what to do, not gRPC's bare "Socket closed"
        assert f"compute instance {compute.address} failed after the request's first tokens" in e.message, e
        assert e.message.endswith("the output so far is partial: send the request again"), e
    clean_s = seconds_to_clean(mesh, timeout_s=4 * TTL_S)
    print(f"compute SIGKILL: no orphans {time.monotonic() - killed_at:.1f} s after the kill (lease {TTL_S} s)")
    assert time.monotonic() - killed_at <= 3 * TTL_S + 2, clean_s  # lease expiry + one lease period
    mesh.respawn(compute)
    with Client(mesh.router_address) as client:
        assert wait_until(lambda: _serves(client), 180)  # loads the model, registers, the router follows


def _servers_listed(mesh: LocalMesh) -> int:
    try:
        return len(cluster_state(mesh.manager_address).servers)
    except Exception:  # noqa: BLE001 - a busy manager may miss one call
        return -1


def _serves(client: Client) -> bool:
    try:
        return client.generate("Hello", max_tokens=2, temperature=0).finish_reason == "length"
    except Exception:  # noqa: BLE001 - the router may still route to the dead address
        return False


def _listed(mesh: LocalMesh) -> tuple[int, int]:
    """(attention servers, compute instances) the leader lists, asked through the mesh's own target."""
    try:
        state = cluster_state(mesh.manager_address, tls=mesh.tls("client"))
    except Exception:  # noqa: BLE001 - no manager leads yet
        return (-1, -1)
    return len(state.servers), len(state.compute_instances)


def test_requests_outlive_a_leader_sigkill_as_its_standby_takes_the_lead_with_identical_output(fault_mesh, references):
    """The hot standby leads once the dead leader's session lease lapses; every client (attention servers,
    the compute instance, the router, ``status``) follows it on the same ``ipv4:A,B`` target."""
    mesh = fault_mesh
    ref = references(48)
    leader, standby = [p for p in mesh.procs if p.role == "manager"]
    assert mesh.manager_address == f"ipv4:{leader.address},{standby.address}"
    assert mesh.leads(leader.address) and not mesh.leads(standby.address)
    assert health_check(standby.address, tls=mesh.tls("client"))  # alive, standing by
    with Client(mesh.router_address) as client:
        short_ids = client.tokenize(TEXT[:200])[:20]  # + 4 new tokens: within its first 2 rBlocks
        short_ref = client.generate(short_ids, max_tokens=4, **GREEDY).token_ids
    streams = Streams(mesh, PROMPTS, max_tokens=48)
    streams.wait_tokens(3)
    short = Streams(mesh, [short_ids], max_tokens=4)  # ends while no manager leads
    short.wait_tokens(1)
    logged_before_kill = len(standby.log_path.read_text(errors="replace"))
    leader.popen.kill()
    killed = time.monotonic()
    time.sleep(3.0)  # past the compute instance's 1 s capacity view, well within the dead leader's 10 s lease
    late = Streams(mesh, [PROMPTS[1]], max_tokens=48)  # arrives while no manager leads: queued, not refused
    assert wait_until(lambda: mesh.leads(standby.address), 30), "the standby never took the lead"
    took_lead_s = time.monotonic() - killed
    for s in (streams, short, late):
        s.join()
    assert (streams.errors, short.errors, late.errors) == ([None, None], [None], [None])
    # sequences that needed rBlocks waited, then went on; the late one was placed by the new leader
    assert (streams.tokens, short.tokens, late.tokens) == (ref, [short_ref], [ref[1]])
    # The new leader lists the servers and the instance that registered with the old one.
    assert wait_until(lambda: _listed(mesh) == (3, 1), 4 * TTL_S), _listed(mesh)
    # ... without losing any of them on the way: their leases outlived the failover (their TTL is 5 s, the
    # dead leader's session lease 10 s), so no prefix-cache entry was dropped and no router saw them go.
    since_kill = standby.log_path.read_text(errors="replace")[logged_before_kill:]
    assert not MEMBER_LOST.findall(since_kill), since_kill
    clean_s = seconds_to_clean(mesh, 4 * TTL_S)
    # A release no manager could take was freed on the servers, and the new leader reconciled its entry.
    (compute,) = mesh.compute_instances()
    freed = re.findall(r"freed \d+ rBlocks of (\S+) on its holders directly", compute.log_path.read_text())
    reclaimed = re.findall(r"reclaimed orphan \w+ of sequence (\S+)", standby.log_path.read_text())
    assert freed and set(freed) <= set(reclaimed), (freed, reclaimed)
    mesh.respawn(leader)  # as Kubernetes restarts its pod: it comes back as the standby
    assert wait_until(lambda: health_check(leader.address, tls=mesh.tls("client")), 60)
    assert not mesh.leads(leader.address) and mesh.leads(standby.address)
    print(f"leader SIGKILLed mid-decode: the standby led {took_lead_s:.1f} s later (the dead leader's session lease);")
    print(f"  {len(freed)} releases taken by the servers meanwhile, reconciled; no orphans {clean_s:.1f} s after")


def test_a_frozen_leader_loses_the_lead_without_costing_any_member_its_registration(fault_mesh, references):
    """SIGSTOP of the leading manager (a paused VM, a stuck node) keeps its connections open and its health
    stream silent. Its clients drop it within seconds (manager channels ping every 2 s), the standby leads
    after the session lease, and every member's heartbeats reach the new leader in time: none is removed,
    so no prefix-index entry is dropped (a walkthrough saw the new leader remove two live attention servers
    whose heartbeats kept timing out on the frozen one). Resumed, the old leader finds its lead gone and
    exits; restarted, it stands by. The streams decode on with identical output."""
    mesh = fault_mesh
    ref = references(48)
    managers = [p for p in mesh.procs if p.role == "manager"]
    leader = next(p for p in managers if mesh.leads(p.address))
    (standby,) = [p for p in managers if p is not leader]
    streams = Streams(mesh, PROMPTS, max_tokens=48)
    streams.wait_tokens(3)
    logged_before = len(standby.log_path.read_text(errors="replace"))
    leader.popen.send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        assert wait_until(lambda: mesh.leads(standby.address), 30), "the standby never took the lead"
        took_lead_s = time.monotonic() - frozen
        time.sleep(TTL_S + 2)  # past a member TTL from the takeover: a member not heard by then is removed
        assert _listed(mesh) == (3, 1)
    finally:
        leader.popen.send_signal(signal.SIGCONT)
    assert leader.popen.wait(timeout=30) == EXIT_LOST_LEADERSHIP
    streams.join()
    assert (streams.errors, streams.tokens) == ([None, None], ref)
    since_freeze = standby.log_path.read_text(errors="replace")[logged_before:]
    assert not MEMBER_LOST.findall(since_freeze), since_freeze
    clean_s = seconds_to_clean(mesh, 4 * TTL_S)
    mesh.respawn(leader)
    assert wait_until(lambda: health_check(leader.address, tls=mesh.tls("client")), 60)
    assert not mesh.leads(leader.address) and mesh.leads(standby.address)
    print(f"leader SIGSTOPped mid-decode: the standby led {took_lead_s:.1f} s later; no member removed;")
    print(f"  no orphans {clean_s:.1f} s after the streams")


def test_requests_outlive_an_etcd_restart_with_identical_output(fault_mesh, references):
    mesh = fault_mesh
    ref = references(48)
    streams = Streams(mesh, PROMPTS, max_tokens=48)
    streams.wait_tokens(3)
    port, data_dir = mesh.etcd.client_port, mesh.etcd.data_dir
    mesh.etcd.stop()
    time.sleep(3.0)
    mesh.etcd = start_etcd(data_dir=data_dir, client_port=port, tls=mesh.etcd.tls)
    streams.join()
    assert streams.errors == [None, None]
    assert streams.tokens == ref
    clean_s = seconds_to_clean(mesh, 4 * TTL_S)
    # The leader rode the outage out, and so did its standby (its campaigns failed meanwhile, and it retried).
    leaders = [p for p in mesh.procs if p.role == "manager" and mesh.leads(p.address)]
    assert len(leaders) == 1 and all(p.alive() for p in mesh.procs if p.role == "manager")
    print(f"etcd down 3 s: no orphans {clean_s:.1f} s after the streams ended")


@pytest.mark.step_recoveries  # it stops an attention server mid-step
def test_attention_server_paused_past_its_lease_is_fenced_and_rejoins_empty(fault_mesh, references):
    mesh = fault_mesh
    ref = references(48)
    streams = Streams(mesh, PROMPTS, max_tokens=48)
    streams.wait_tokens(3)
    placed = {s for shares in ledger(mesh).values() for s, _ in shares}
    victim = next(p for p in mesh.attention_servers() if p.name in placed)
    victim.popen.send_signal(signal.SIGSTOP)
    time.sleep(2 * TTL_S)  # silent past its TTL: the leading manager removes it
    victim.popen.send_signal(signal.SIGCONT)
    streams.join()
    assert streams.errors == [None, None]
    assert streams.tokens == ref  # its sequences were recomputed elsewhere
    assert wait_until(lambda: "fenced" in victim.log_path.read_text(errors="replace"), 2 * TTL_S)
    assert wait_until(lambda: _servers_listed(mesh) == len(mesh.attention_servers()), 60)  # it rejoined
    print(f"attention SIGSTOP {2 * TTL_S} s: no orphans {seconds_to_clean(mesh, 4 * TTL_S):.1f} s after the streams")


def test_a_stopping_router_whose_grace_runs_out_ends_its_streams_with_unavailable_and_frees_them(fault_mesh):
    """A stream longer than the router's --shutdown-grace (2 s) ends, just before the grace is out, with
    UNAVAILABLE saying the router is shutting down (it was gRPC's bare CANCELLED "Cancelling all calls"); the
    compute instance aborts the request and every rBlock is free again."""
    mesh = fault_mesh
    router = mesh.spawn_router("router-grace", shutdown_grace_s=2.0)
    assert wait_until(lambda: health_check(router.address, tls=mesh.tls("client")), 60)
    tokens: list[int] = []
    ended: list[BaseException | None] = []

    def stream() -> None:
        try:
            with Client(router.address) as client:
                for chunk in client.stream(PROMPTS[0], max_tokens=300, timeout=240, **GREEDY):
                    tokens.extend(chunk.token_ids)
            ended.append(None)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            ended.append(e)

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert wait_until(lambda: len(tokens) >= 2 or ended, 120), ended
    router.popen.terminate()
    stopping_at = time.monotonic()
    thread.join(30)
    took = time.monotonic() - stopping_at
    assert not thread.is_alive(), "the stream outlived its router"
    assert len(ended) == 1 and isinstance(ended[0], Unavailable), ended
    assert "the router is shutting down" in str(ended[0]), ended[0]
    assert 0.5 < took < 2.0 + 5.0, took  # ended by the router near the end of its grace, not at once or late
    assert router.popen.wait(timeout=30) == 0
    mesh.procs.remove(router)  # the mesh's own router stays the one other tests stop
    assert wait_until(lambda: no_orphans(mesh), 60), (ledger(mesh), "rBlocks or ledger entries leaked")


def test_sigterm_to_the_router_refuses_new_requests_and_lets_streams_in_flight_finish(fault_mesh, references):
    mesh = fault_mesh
    ref = references(32)
    streams = Streams(mesh, PROMPTS, max_tokens=32)
    streams.wait_tokens(2)
    router = next(p for p in mesh.procs if p.name == "router")
    router.popen.terminate()
    stopping_at = time.monotonic()
    assert wait_until(lambda: not health_check(router.address, tls=mesh.tls("client")), 5)
    with Client(mesh.router_address) as client, pytest.raises(Unavailable):
        client.generate("Hello", max_tokens=2, timeout=10)
    streams.join()
    assert streams.errors == [None, None]
    assert streams.tokens == ref  # every token of the requests in flight arrived
    assert router.popen.wait(timeout=mesh.config.shutdown_grace_s) == 0
    print(f"router SIGTERM: streams in flight finished, router exited {time.monotonic() - stopping_at:.1f} s later")
    mesh.respawn(router)
    with Client(mesh.router_address) as client:
        assert wait_until(lambda: _serves(client), 60)
