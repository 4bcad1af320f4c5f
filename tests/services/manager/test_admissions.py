"""First come, first served admission across compute instances (services/manager/admissions.py): the claims'
rules on a fake clock, the manager's Place over real etcd and rManagers, and two compute instances'
schedulers placing through the served manager, where a long prompt used to starve."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.services.admin import render_status
from infinite_llm.services.manager.admissions import AdmissionClaims

from .helpers import make_servers, running_manager
from .test_compute_rpc import served


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_older_claim_holds_back_younger_admissions_that_would_take_its_rblocks():
    clock = Clock()
    claims = AdmissionClaims(ttl_s=5, hold_s=30, clock=clock)
    claims.check("long", 5, free_blocks=4, capacity_blocks=6)  # no claims yet: the check passes
    claims.claim("long", 5)  # ... and the placement itself found 4 free: refused, claimed
    clock.now += 1
    with pytest.raises(CapacityExhausted, match="1 older admission"):
        claims.check("short", 2, free_blocks=4, capacity_blocks=6)  # 4 - 2 < 5
    claims.check("short", 1, free_blocks=6, capacity_blocks=6)  # 6 - 1 >= 5: room for both
    claims.check("long", 5, free_blocks=5, capacity_blocks=6)  # the claimant itself: nobody older
    claims.drop("long")  # admitted
    claims.check("short", 2, free_blocks=1, capacity_blocks=6)  # its own claim alone: the check passes
    assert [s for s, _ in claims.waiting()] == ["short"]
    claims.drop("short")
    assert claims.waiting() == []


def test_a_claim_lapses_when_unrenewed_when_it_outgrows_the_cluster_and_stops_holding_after_hold_s():
    clock = Clock()
    claims = AdmissionClaims(ttl_s=5, hold_s=30, clock=clock)
    claims.claim("gone", 5)
    clock.now += 5.5  # its instance stopped asking (aborted, died)
    assert claims.waiting() == []  # lapsed (a scrape reads no stale claim)
    claims.check("other", 2, free_blocks=3, capacity_blocks=6)
    assert [s for s, _ in claims.waiting()] == []

    claims.claim("big", 5)
    claims.check("other", 2, free_blocks=3, capacity_blocks=4)  # servers left: 5 can never fit in 4
    assert claims.waiting() == []

    claims.claim("stuck", 5)
    for _ in range(7):  # renewed every 4.5 s for 31.5 s: still claimed, but holds nobody back after 30 s
        clock.now += 4.5
        claims.claim("stuck", 5)
    claims.check("other", 2, free_blocks=3, capacity_blocks=6)
    assert [s for s, _ in claims.waiting()] == ["stuck"]
    with pytest.raises(ValueError):
        AdmissionClaims(ttl_s=0)


def test_an_instance_is_not_held_back_by_its_own_older_claims():
    """An instance orders its own queue: a sequence it preempted goes back before its waiting head and asks
    first; waiting for that head's claim as well would need both to fit at once."""
    clock = Clock()
    claims = AdmissionClaims(clock=clock)
    claims.claim("head", 5, owner="A")
    clock.now += 1
    claims.check("preempted", 2, free_blocks=3, capacity_blocks=6, owner="A")
    with pytest.raises(CapacityExhausted):
        claims.check("other", 2, free_blocks=3, capacity_blocks=6, owner="B")
    claims.drop_owner("A")  # A deregistered
    assert [s for s, _ in claims.waiting()] == ["other"]
    claims.reset()
    assert claims.waiting() == []


def test_a_heartbeat_renews_its_instances_listed_claims_and_ends_the_unlisted_ones_after_a_grace():
    clock = Clock()
    claims = AdmissionClaims(ttl_s=5, hold_s=30, clock=clock)
    claims.claim("a1", 3, owner="A")
    claims.claim("a2", 3, owner="A")
    claims.claim("b1", 3, owner="B")
    clock.now += 1.5
    assert claims.renew("A", []) == 0  # made 1.5 s ago: the heartbeat may have been read before the refusal
    clock.now += 3
    assert claims.renew("A", ["a1"]) == 1  # a2 ended (aborted while waiting); a1 renewed
    clock.now += 4  # 8.5 s since made, 4 since renewed
    assert [(s, c.owner, c.since) for s, c in claims.waiting()] == [("a1", "A", 100.0)]  # b1 lapsed; a1 kept its turn
    assert claims.renew("B", ["b1"]) == 0  # a lapsed claim is not brought back
    assert [s for s, _ in claims.waiting()] == ["a1"] and claims.renew("A", ["a1"]) == 0


def test_the_manager_serves_admissions_in_order_and_never_holds_back_growth(etcd_server, etcd_prefix):
    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 6})) as m:
            await m.place("b1", 2, admission=True)
            with pytest.raises(CapacityExhausted):
                await m.place("long", 5, admission=True)  # 4 free
            with pytest.raises(CapacityExhausted, match="older admission"):
                await m.place("b2", 2, admission=True)  # would leave 2 < 5
            assert [g.block_ids for g in await m.place("b1", 1)] == [(2,)]  # growth: placed
            await m.release("b1")
            assert sum(g.n_blocks for g in await m.place("long", 5, admission=True)) == 5
            assert [s for s, _ in m.admissions.waiting()] == ["b2"]
            with pytest.raises(CapacityExhausted):
                await m.place("b2", 2, admission=True)  # 1 free
            await m.release("long")
            assert sum(g.n_blocks for g in await m.place("b2", 2, admission=True)) == 2
            assert m.admissions.waiting() == []
            with pytest.raises(CapacityExhausted):
                await m.place("c", 5, admission=True)  # 3 free: claimed
            m.leadership.leading_since += 1e-3  # as when this manager lost the lead and took it again
            await m.place("d", 1, admission=True)  # the claims of the earlier term are gone: placed
            assert m.admissions.waiting() == []

    asyncio.run(scenario())


def test_a_claim_names_only_an_owner_the_caller_speaks_for_and_a_retried_admission_is_not_held_back(
    etcd_server, etcd_prefix
):
    """A caller naming another identity's instance is refused before any claim is made (it could otherwise
    hold every admission back, or take over another instance's claim). An admission retried after its reply
    was lost (the ledger has its rBlocks) is placed again idempotently, not refused for younger claims."""
    from infinite_llm.core.errors import PermissionDenied
    from infinite_llm.services.manager.computes import ComputeInfo

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 6})) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",), identity="CN=compute-0"))
            await m.register_compute(ComputeInfo("c1", "127.0.0.1:50071", ("a",), identity="CN=compute-1"))
            with pytest.raises(PermissionDenied):
                await m.place("x", 7, owner="c0", identity="CN=compute-1", admission=True)
            assert m.admissions.waiting() == []
            await m.place("s", 2, first_index=0, owner="c0", identity="CN=compute-0", admission=True)
            with pytest.raises(CapacityExhausted):
                await m.place("long", 5, owner="c1", identity="CN=compute-1", admission=True)  # 4 free: claimed
            with pytest.raises(PermissionDenied):  # not a claim under c0's name behind "long"
                await m.place("y", 2, owner="c0", identity="CN=compute-1", admission=True)
            assert [s for s, _ in m.admissions.waiting()] == ["long"]
            # c0 never heard back about "s" and asks again: placed again (4 free - 2 < 5 would refuse a new one)
            grants = await m.place("s", 2, first_index=0, owner="c0", identity="CN=compute-0", admission=True)
            assert sum(g.n_blocks for g in grants) == 2 and (await m.cluster_state()).ledger["s"] == [("a", 2)]
            await m.deregister_compute("c1")
            assert m.admissions.waiting() == []  # its waiting requests went with it

    asyncio.run(scenario())


def test_a_long_prompt_on_one_instance_is_admitted_while_another_keeps_admitting_short_ones(
    etcd_server, etcd_prefix, monkeypatch
):
    """Two compute instances' schedulers place through the served manager in one server of 6 rBlocks of 4
    tokens. Instance B runs short sequences; instance A's 19-token prompt needs 5 rBlocks. Before claims,
    each rBlock B freed went to B's next short sequence, and A's prompt waited for as long as B had work.
    Now B's next admission waits behind A's older one; B's running sequence still grows, and A is admitted
    as soon as it ends."""
    from infinite_llm.core.dist_attention import DistAttention
    from infinite_llm.core.sampling import SamplingParams
    from infinite_llm.core.scheduler import Scheduler, SchedulerConfig, Sequence
    from infinite_llm.services.compute import remote_kv

    monkeypatch.setattr(remote_kv, "CAPACITY_REFRESH_S", 0.0)  # every capacity read asks the manager

    def seq(sid: str, n_prompt: int, max_tokens: int) -> Sequence:
        return Sequence(sid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))

    async def scenario():
        async with running_manager(etcd_server, etcd_prefix, make_servers({"a": 6})) as m, served(m) as stub:
            instances = {}
            for name in ("A", "B"):
                placement = remote_kv.ManagerPlacement(stub.address, block_size=4, timeout_s=10.0, instance_id=name)
                instances[name] = Scheduler(SchedulerConfig(8, 8), DistAttention(placement, None, block_size=4))

            def step(name: str) -> list[str]:
                """One step of instance ``name``: what it ran; a sequence ends when it has its tokens."""
                sched = instances[name]
                out = sched.schedule()
                sched.mark_computed(out)
                for s in out.scheduled:
                    if s.samples:
                        s.seq.output_token_ids.append(7)
                        if len(s.seq.output_token_ids) == s.seq.params.max_tokens:
                            sched.finish(s.seq, "length")
                return [s.seq.seq_id for s in out.scheduled]

            a_sched, b_sched = instances["A"], instances["B"]
            b1, b2, a = seq("b1", 8, 2), seq("b2", 7, 1), seq("a", 19, 1)
            await asyncio.to_thread(b_sched.add, b1)  # blocking calls: off the manager's event loop
            assert await asyncio.to_thread(step, "B") == ["b1"]  # 2 rBlocks; 4 free
            await asyncio.to_thread(a_sched.add, a)
            assert await asyncio.to_thread(step, "A") == []  # needs 5: refused, claimed
            await asyncio.to_thread(b_sched.add, b2)
            # b1's decode grows it to a 3rd rBlock (3 free < a's 5: growth is not held back); b2's admission (2
            # rBlocks) waits behind a's; b1 ends with its 2nd token, and its release frees all 6
            assert await asyncio.to_thread(step, "B") == ["b1"]
            assert list(b_sched.waiting) == [b2] and [s for s, _ in m.admissions.waiting()] == ["a", "b2"]
            state = await stub.GetClusterState(mpb.ClusterStateRequest())
            waiting = [(w.seq_id, w.instance_id, w.num_blocks, w.holding) for w in state.waiting_admissions]
            assert waiting == [("a", "A", 5, True), ("b2", "B", 2, True)]
            assert all(0 <= w.waiting_s < 10 for w in state.waiting_admissions)
            console = Console(record=True, width=200)
            render_status(state, console)
            text = console.export_text()
            assert "waiting admissions" in text and "first come, first served across compute instances" in text
            lines = [ln.split() for ln in text.split("waiting admissions", 1)[1].splitlines()]
            assert [ln[1:4] for ln in lines if ln[:1] == ["│"] and ln[1:2] in (["a"], ["b2"])] == [
                ["a", "│", "A"],
                ["b2", "│", "B"],
            ]
            metrics = stub.servicer.metrics
            gauges = [g.collect()[0].samples[0] for g in (metrics.admission_claims, metrics.admission_claimed_rblocks)]
            assert [(g.name, g.value) for g in gauges] == [
                ("infinite_llm:admission_claims", 2),
                ("infinite_llm:admission_claimed_rblocks", 5 + 2),
            ]
            assert b1.status.name == "FINISHED" and (await m.cluster_state()).members[0].free_blocks == 6
            assert await asyncio.to_thread(step, "A") == ["a"]  # the whole prompt's 5 rBlocks at once
            assert await asyncio.to_thread(step, "B") == []  # 1 free: b2 still waits
            while a.status.name != "FINISHED":
                assert "a" in await asyncio.to_thread(step, "A")
            assert await asyncio.to_thread(step, "B") == ["b2"]
            assert a.num_preemptions == 0 and b_sched.num_preemptions == 0
            await asyncio.to_thread(step, "B")
            assert (await m.cluster_state()).ledger == {} and m.admissions.waiting() == []

    asyncio.run(scenario())


def test_heartbeats_keep_a_waiting_claim_through_a_full_cluster_and_end_it_once_its_request_ended(
    etcd_server, etcd_prefix, monkeypatch
):
    """An instance that sees no free rBlock does not ask again, so a full cluster could let its claim lapse and
    put it behind later ones. Its heartbeats (a real ``ComputeRegistrar``, every second at a 3 s member TTL)
    list its claimed waiting sequences, which keeps the claim; once the request ends while waiting (aborted),
    the next heartbeats end the claim, not the TTL."""
    from infinite_llm.core.dist_attention import DistAttention
    from infinite_llm.core.sampling import SamplingParams
    from infinite_llm.core.scheduler import Scheduler, SchedulerConfig, Sequence
    from infinite_llm.services.compute import remote_kv
    from infinite_llm.services.compute.registrar import ComputeLoadReport, ComputeRegistrar

    from .helpers import wait_for

    monkeypatch.setattr(remote_kv, "CAPACITY_REFRESH_S", 0.0)

    async def scenario():
        async with (
            running_manager(etcd_server, etcd_prefix, make_servers({"a": 6}), member_ttl_s=3) as m,
            served(m) as stub,
        ):
            m.admissions = AdmissionClaims(ttl_s=2.5)  # lapses within 6 s unless heartbeats (each second) renew it
            placement = remote_kv.ManagerPlacement(stub.address, block_size=4, timeout_s=10.0, instance_id="A")
            sched = Scheduler(SchedulerConfig(8, 8), DistAttention(placement, None, block_size=4))
            load = lambda: ComputeLoadReport(0, 1, 0, waiting_seq_ids=tuple(placement.claimed_seq_ids()))  # noqa: E731
            registrar = ComputeRegistrar(stub.address, "A", "127.0.0.1:50070", load)
            registrar.start()
            try:
                await asyncio.wait_for(registrar.registered.wait(), 5)
                await m.place("other", 4, admission=True)
                a = Sequence("a", list(range(1, 11)), SamplingParams(max_tokens=1, temperature=0))  # 3 rBlocks
                await asyncio.to_thread(sched.add, a)
                assert not (await asyncio.to_thread(sched.schedule)).scheduled  # 2 free: refused, claimed
                assert placement.claimed_seq_ids() == ["a"]
                await m.place("other", 2)  # "other" grows: the cluster is full
                for _ in range(12):  # 6 s, > 2 TTLs, without another Place (no free rBlock: the head waits)
                    assert not (await asyncio.to_thread(sched.schedule)).scheduled
                    await asyncio.sleep(0.5)
                assert [(s, c.owner) for s, c in m.admissions.waiting()] == [("a", "A")]
                m.admissions.ttl_s = 60.0  # from here only a heartbeat can end it in time
                await asyncio.to_thread(sched.finish, a, "abort")
                assert placement.claimed_seq_ids() == []
                ended = await wait_for(lambda: not m.admissions.waiting(), 10)
                assert ended < 5.0  # the next heartbeats (each second), after 2 s of grace; not the 60 s TTL
            finally:
                await registrar.stop()

    asyncio.run(scenario())
