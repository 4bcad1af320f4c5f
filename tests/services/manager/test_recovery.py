"""Restart recovery from etcd and leader fencing between global-manager instances."""

from __future__ import annotations

import asyncio
import time

import pytest

from infinite_llm.core.errors import CapacityExhausted, Unavailable
from infinite_llm.core.prefix_cache import block_hashes
from infinite_llm.services.manager import GlobalManager, Grant, ManagerConfig, MemberInfo, NotLeader
from infinite_llm.state.etcd_launcher import start_etcd

from .helpers import make_servers, open_store, pool_state, running_manager, wait_for


def test_new_manager_recovers_members_ledger_and_capacity_after_a_crash(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8, "b": 4})
        async with open_store(etcd_server, etcd_prefix) as store:
            first = GlobalManager(store, servers, ManagerConfig("m1", block_size=4, leader_ttl_s=2))
            await first.start(acquire_timeout_s=5)
            await first.register("a", "10.0.0.1:50051", 8, 4)
            await first.register("b", "10.0.0.2:50051", 4, 4)
            await first.place("s1", 5, near="a")
            await first.place("s2", 3, near="b")
            await first.stop(resign=False)  # a crash: the leader key lingers until its lease expires
        async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False) as second:
            assert second.is_leader
            state = await second.cluster_state()
            assert state.leader == "m2"
            assert [(s.info.server_id, s.info.address, s.free_blocks) for s in state.members] == [
                ("a", "10.0.0.1:50051", 3),
                ("b", "10.0.0.2:50051", 1),
            ]
            assert state.ledger == {"s1": [("a", 5)], "s2": [("b", 3)]}
            assert await second.place("s3", 4) == [Grant("a", 3, (5, 6, 7)), Grant("b", 1, (3,))]
            assert await second.release("s1") == 5
            assert servers.rmanagers["a"].sequences() == ["s3"]

    asyncio.run(scenario())


def test_takeover_waits_for_the_crashed_leaders_lease(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store:
            first = GlobalManager(store, make_servers({}), ManagerConfig("m1", block_size=4, leader_ttl_s=2))
            await first.start(acquire_timeout_s=5)
            await first.stop(resign=False)
            second = GlobalManager(store, make_servers({}), ManagerConfig("m2", block_size=4))
            start = time.monotonic()
            await second.start(acquire_timeout_s=10)
            assert second.is_leader and 0.5 < time.monotonic() - start < 5
            await second.stop()

    asyncio.run(scenario())


def test_second_manager_cannot_write_while_the_first_leads(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as leader:
            await leader.place("s", 2)
            async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False, lead=False) as other:
                before = pool_state(servers), (await leader.cluster_state()).ledger
                assert not other.is_leader and (await other.cluster_state()).leader == "m1"
                with pytest.raises(NotLeader, match="m2 is not the leader"):
                    await other.place("t", 1)
                with pytest.raises(NotLeader):
                    await other.release("s")
                with pytest.raises(NotLeader):
                    await other.register("z", "10.0.0.9:50051", 4, 4)
                with pytest.raises(NotLeader, match="within 0.3 s"):
                    await other.acquire_leadership(0.3)
                assert (pool_state(servers), (await leader.cluster_state()).ledger) == before
                assert [m.info.server_id for m in other.members()] == ["a"]

    asyncio.run(scenario())


def test_deposed_leader_is_fenced_by_etcd_even_while_it_believes_it_leads(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with (
            running_manager(etcd_server, etcd_prefix, servers, leader_ttl_s=30) as old,
            open_store(etcd_server, etcd_prefix) as raw,
        ):
            await raw.revoke_lease(old.leadership.lease_id)  # its session lapses (a partition, a long pause)
            async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False) as new:
                assert old.is_leader  # it has not noticed: only etcd's compare stops it
                before = pool_state(servers)
                with pytest.raises(NotLeader, match="lost leadership .*m2"):
                    await old.place("s", 2)
                assert not old.is_leader and pool_state(servers) == before
                assert await raw.get("ledger/s") is None
                assert await new.place("s", 2) == [Grant("a", 2, (2, 3))]

    asyncio.run(scenario())


def test_member_view_and_ledger_survive_an_etcd_restart(tmp_path):
    async def scenario():
        etcd = start_etcd(data_dir=tmp_path / "etcd")
        servers = make_servers({"a": 4, "b": 4})
        try:
            async with running_manager(etcd, "/infinite-llm/", servers, register=False) as m:
                reg = await m.register("a", "10.0.0.1:50051", 4, 4, ttl_s=30)
                await m.place("s", 3)
                etcd.stop()
                etcd = start_etcd(data_dir=tmp_path / "etcd", client_port=etcd.client_port)
                async with open_store(etcd, "/infinite-llm/") as raw:
                    await raw.put("members/b", MemberInfo("b", "10.0.0.2:50051", 4, 16).to_json())
                    await wait_for(lambda: [x.info.server_id for x in m.members()] == ["a", "b"], timeout_s=15)
                    await raw.revoke_lease(reg.lease_id)
                    await wait_for(lambda: [x.info.server_id for x in m.members()] == ["b"], timeout_s=5)
                assert (await m.cluster_state()).ledger == {"s": [("a", 3)]}
                assert await m.place("t", 2) == [Grant("b", 2, (0, 1))]
        finally:
            etcd.stop()

    asyncio.run(scenario())


def test_a_new_leader_neither_drops_nor_calls_full_the_servers_not_registered_again_while_it_settles(
    etcd_server, etcd_prefix
):
    """A manager restart outlasts its members' leases; the attention servers keep their rBlocks and register
    again within a heartbeat of reaching the new leader. Until they do (``settle_s``), a free that would skip
    them (Release, a repeated Place's truncation, a repeated MatchPrefix's undo) and a placement that finds no
    room are refused with ``Unavailable`` and change nothing: a ledger entry dropped past a server still
    holding its rBlocks let a preempted sequence's next placement collide with its own leftovers (a CI run
    lost a request and another's greedy output drifted). Once the server is back the same calls succeed;
    after the window an unregistered server counts as lost again."""

    async def scenario():
        servers = make_servers({"a": 4})
        a = servers.rmanagers["a"]
        hashes = block_hashes(list(range(8)), 4, "m")
        async with running_manager(etcd_server, etcd_prefix, servers, "m1") as first:
            await first.place("s", 2, owner="c1")
            await first.deregister("a")  # its lease lapsed while no manager led
        async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False, settle_s=60.0) as second:
            assert second.settling
            calls = {
                "release": lambda: second.release("s"),
                "place again": lambda: second.place("s", 1, first_index=0, owner="c1"),
                "match again": lambda: second.prefix.match("s", hashes, owner="c1"),
                "place new": lambda: second.place("t", 1, owner="c1"),
            }
            for name, call in calls.items():
                with pytest.raises(Unavailable, match="registering again|not registered again"):
                    await call()
                assert (await second.cluster_state()).ledger == {"s": [("a", 2)]}, name
                assert (a.sequences(), a.owned_blocks("s"), a.pool.num_free) == (["s"], [0, 1], 2), name

            await second.register("a", "a.local:50051", 4, 4)
            assert await second.place("s", 1, first_index=0, owner="c1") == [Grant("a", 1, (2,))]
            assert (await second.cluster_state()).ledger == {"s": [("a", 1)]}  # truncated, then placed
            assert await second.release("s") == 1
            assert ((await second.cluster_state()).ledger, a.sequences(), a.pool.num_free) == ({}, [], 4)

            await second.place("s", 2, owner="c1")
            await second.deregister("a")
            second.leadership.leading_since -= 60.0  # the window is over: a server not registered is lost
            assert not second.settling
            with pytest.raises(CapacityExhausted):
                await second.place("t", 1, owner="c1")
            assert await second.release("s") == 2  # LocalServers reaches it; over gRPC it is skipped
            assert (await second.cluster_state()).ledger == {}

    asyncio.run(scenario())
