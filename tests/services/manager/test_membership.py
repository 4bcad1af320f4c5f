"""Membership in etcd: leased member keys, heartbeats as keep-alive, and the watch-fed member view."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from infinite_llm.core.errors import FailedPrecondition, InvalidRequest, NotFound
from infinite_llm.services.manager import GlobalManager, ManagerConfig
from infinite_llm.services.manager.computes import ComputeInfo

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


def _instances(manager) -> list[str]:
    return [m.info.instance_id for m in manager.computes.members.members()]


def test_members_outlive_a_leader_crash_and_the_new_leader_removes_the_silent_ones(etcd_server, etcd_prefix):
    """A leader's crash silences every member until a standby leads (after the leader's session lease of 3 s
    here), longer than their 2 s TTL. Their registrations survive it (each lease is the TTL plus a grace
    longer than the leader's); the new leader gives every member a TTL from its takeover, keeps the server
    that heartbeats it, and removes the server and the compute instance that stay silent (their keys go)."""

    async def scenario():
        servers = make_servers({"a": 4, "b": 4})
        config = dict(block_size=4, member_ttl_s=2, leader_ttl_s=3)
        async with open_store(etcd_server, etcd_prefix) as store, open_store(etcd_server, etcd_prefix) as raw:
            first = GlobalManager(store, servers, ManagerConfig("m1", **config))
            await first.start(acquire_timeout_s=5)
            reg_a = await first.register("a", "10.0.0.1:50051", 4, 4)
            await first.register("b", "10.0.0.2:50051", 4, 4)
            await first.register_compute(ComputeInfo("c0", "10.0.1.1:50070", ("a",)))
            async with running_manager(
                etcd_server, etcd_prefix, servers, "m2", register=False, lead=False, **config
            ) as second:
                assert not second.is_leader and _ids(second) == ["a", "b"]
                crashed = time.monotonic()
                await first.stop(resign=False)  # its session lease, the leader key and the members' leases linger
                await second.acquire_leadership(10)
                took_over = time.monotonic()
                assert took_over - crashed > 2.0  # every member was silent longer than its TTL
                assert _ids(second) == ["a", "b"] and _instances(second) == ["c0"]

                async def heartbeats():
                    while True:
                        await second.heartbeat("a", free_blocks=4)
                        await asyncio.sleep(0.5)

                beating = asyncio.create_task(heartbeats())
                try:
                    await wait_for(lambda: _ids(second) == ["a"] and _instances(second) == [], timeout_s=6)
                    assert time.monotonic() - took_over > 1.9  # a TTL from the takeover, not from the crash
                    await asyncio.sleep(2.5)  # more than a TTL: the heartbeats keep "a"
                    assert _ids(second) == ["a"]
                finally:
                    beating.cancel()
                assert (await raw.get("members/a")).lease == reg_a.lease_id
                assert await raw.get("members/b") is None and await raw.get("computes/c0") is None
            await store.revoke_lease(reg_a.lease_id)

    asyncio.run(scenario())


def test_a_stalled_leader_gives_its_members_a_ttl_before_removing_any(etcd_server, etcd_prefix):
    """A leader whose event loop stalled longer than the members' TTL could not hear their heartbeats
    meanwhile: it does not remove them for that silence; one heartbeat after the stall keeps the member."""

    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False, member_ttl_s=2) as m:
            await m.register("a", "10.0.0.1:50051", 4, 4)
            await asyncio.sleep(0.6)  # its silence checks run
            time.sleep(2.5)  # the whole manager stalls (blocks its event loop)
            await asyncio.sleep(0.6)  # its silence checks run before the member's next heartbeat arrives
            await m.heartbeat("a", free_blocks=4)
            await asyncio.sleep(1.0)
            assert _ids(m) == ["a"]
            gone_after_s = await wait_for(lambda: _ids(m) == [], timeout_s=5)  # no more heartbeats
            assert gone_after_s > 0.5

    asyncio.run(scenario())


def test_an_etcd_outage_longer_than_the_ttl_removes_no_member_that_kept_heartbeating(tmp_path, caplog):
    """etcd down 3.5 s with a 2 s TTL: the member's heartbeats reach the manager but fail (no lease to refresh).
    The manager counts them as heard: it never sets out to remove the member (it would, as soon as etcd
    answered again), which stays listed; silent from then, it is removed a TTL later. A private etcd (this
    test stops it)."""
    from infinite_llm.state.etcd_launcher import start_etcd

    async def scenario():
        nonlocal etcd
        servers = make_servers({"a": 4})
        async with running_manager(etcd, "/infinite-llm/", servers, register=False, member_ttl_s=2) as m:
            await m.register("a", "10.0.0.1:50051", 4, 4)
            failed = []

            async def heartbeats():
                while True:
                    try:
                        await m.heartbeat("a", free_blocks=4)
                    except Exception as e:  # noqa: BLE001 - etcd is down: Unavailable
                        failed.append(type(e).__name__)
                    await asyncio.sleep(0.5)

            beating = asyncio.create_task(heartbeats())
            await asyncio.sleep(0.6)
            with caplog.at_level(logging.WARNING, logger="infinite_llm.services.manager.membership"):
                etcd.stop()
                await asyncio.sleep(3.5)
                etcd = start_etcd(data_dir=tmp_path / "etcd", client_port=etcd.client_port)
                await asyncio.sleep(1.5)
            beating.cancel()
            assert failed and set(failed) == {"Unavailable"}, failed
            assert not [r.getMessage() for r in caplog.records if "not heard from" in r.getMessage()]
            assert _ids(m) == ["a"]
            gone_after_s = await wait_for(lambda: _ids(m) == [], timeout_s=10)
            assert gone_after_s > 1.0

    etcd = start_etcd(data_dir=tmp_path / "etcd")
    try:
        asyncio.run(scenario())
    finally:
        etcd.stop()


def test_a_member_whose_kv_layout_differs_from_the_live_ones_is_refused_and_not_registered(etcd_server, etcd_prefix):
    """The first members fix the cluster's KV (model and dtype); an attention server or compute instance of
    another is refused before anything is placed on it or for it; one that does not tell (an older build) is
    not checked, and its record reads as before."""
    fp32 = "float32 for 30 layers x 3 KV heads x 64"
    bf16 = "bfloat16 for 30 layers x 3 KV heads x 64"

    async def scenario():
        servers = make_servers({"a": 8, "b": 8, "c": 8})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False, block_size=4) as m:
            await m.register("a", "10.0.0.1:50051", 8, 4, kv_layout=fp32)
            with pytest.raises(FailedPrecondition) as refused:
                await m.register("b", "10.0.0.2:50051", 8, 4, kv_layout=bf16)
            assert str(refused.value.message) == (
                f"attention server 'b' keeps KV as {bf16}; this cluster's live members (attention server a) use "
                f"{fp32}: give every attention server and compute instance of a cluster the same model and dtype"
            )
            await m.register("c", "10.0.0.3:50051", 8, 4)  # not told: not checked
            with pytest.raises(
                FailedPrecondition, match=f"compute instance 'c0' needs KV as {bf16}; .*attention server a"
            ):
                await m.register_compute(ComputeInfo("c0", "10.0.1.1:50070", kv_layout=bf16))
            await m.register_compute(ComputeInfo("c1", "10.0.1.2:50070", kv_layout=fp32))
            await m.register("a", "10.0.0.1:50051", 8, 4, kv_layout=fp32)  # a restart of a: itself is no conflict
            assert _ids(m) == ["a", "c"] and _instances(m) == ["c1"]
            async with open_store(etcd_server, etcd_prefix) as raw:
                assert await raw.get("members/b") is None and await raw.get("computes/c0") is None
                assert json.loads((await raw.get("members/a")).value)["kv_layout"] == fp32
                assert "kv_layout" not in json.loads((await raw.get("members/c")).value)
                assert json.loads((await raw.get("computes/c1")).value)["kv_layout"] == fp32

    asyncio.run(scenario())
