"""Membership in etcd: leased member keys, heartbeats as keep-alive, and the watch-fed member view."""

from __future__ import annotations

import asyncio
import json

import pytest

from infinite_llm.core.errors import FailedPrecondition, InvalidRequest, NotFound

from .helpers import make_servers, open_store, running_manager, wait_for


def _ids(manager) -> list[str]:
    return [m.info.server_id for m in manager.members()]


def test_registered_server_appears_in_members_and_etcd(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"b": 4, "a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False) as m:
            reg = await m.register("a", "10.0.0.1:50051", 8, 4, kind="attention", ttl_s=5)
            await m.register("b", "10.0.0.2:50051", 4, 4)
            assert _ids(m) == ["a", "b"]
            assert m.members()[0].lease_id == reg.lease_id and reg.ttl_s == 5
            async with open_store(etcd_server, etcd_prefix) as raw:
                kv = await raw.get("members/a")
            assert kv.lease == reg.lease_id
            assert json.loads(kv.value) == {
                "address": "10.0.0.1:50051",
                "block_size": 4,
                "capacity_blocks": 8,
                "kind": "attention",
            }
            state = await m.cluster_state()
            assert [(s.info.server_id, s.free_blocks, s.stale) for s in state.members] == [
                ("a", 8, False),
                ("b", 4, False),
            ]
            with pytest.raises(InvalidRequest):
                await m.register("bad/id", "x", 1, 4)

    asyncio.run(scenario())


def test_a_follower_sees_members_through_its_watch(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False) as leader:
            async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False, lead=False) as follower:
                assert _ids(follower) == []
                await leader.register("a", "10.0.0.1:50051", 4, 4)
                await wait_for(lambda: _ids(follower) == ["a"], timeout_s=5)
                await leader.deregister("a")
                await wait_for(lambda: _ids(follower) == [], timeout_s=5)

    asyncio.run(scenario())


def test_member_vanishes_when_its_lease_is_revoked(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m, open_store(etcd_server, etcd_prefix) as raw:
            await m.deregister("a")
            assert _ids(m) == ["b"] and await raw.get("members/a") is None
            await raw.revoke_lease(m.members()[0].lease_id)  # revoked outside the manager
            await wait_for(lambda: _ids(m) == [], timeout_s=5)
            assert "b" not in m.view
            with pytest.raises(NotFound):
                await m.deregister("b")

    asyncio.run(scenario())


def test_member_vanishes_after_ttl_once_heartbeats_stop(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False) as m:
            await m.register("a", "10.0.0.1:50051", 8, 4, ttl_s=2)

            async def heartbeats():
                while True:
                    await m.heartbeat("a", free_blocks=5, load=2.0)
                    await asyncio.sleep(0.5)

            beating = asyncio.create_task(heartbeats())
            await asyncio.sleep(3.0)  # 1.5 TTLs: alive only because of the heartbeats
            assert _ids(m) == ["a"]
            state = await m.cluster_state()
            assert (state.members[0].free_blocks, state.members[0].load) == (5, 2.0)
            beating.cancel()
            gone_after_s = await wait_for(lambda: _ids(m) == [], timeout_s=6)
            assert gone_after_s > 1.0  # the TTL, not something else, removed it
            with pytest.raises(NotFound, match="'a'"):
                await m.heartbeat("a", free_blocks=5)

    asyncio.run(scenario())


def test_a_server_with_another_block_size_is_refused_and_nothing_is_registered(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 8})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False, block_size=4) as m:
            with pytest.raises(FailedPrecondition, match="uses rBlocks of 16 tokens; this cluster's block_size is 4"):
                await m.register("a", "10.0.0.1:50051", 8, 16)
            assert _ids(m) == []
            async with open_store(etcd_server, etcd_prefix) as raw:
                assert await raw.get("members/a") is None
            with pytest.raises(FailedPrecondition, match="the caller placing 's'"):
                m.check_block_size(8, "the caller placing 's'")

    asyncio.run(scenario())
