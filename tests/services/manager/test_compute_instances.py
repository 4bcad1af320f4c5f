"""Compute instances in the cluster view: leased ``computes/`` keys, load heartbeats, homes and debts."""

from __future__ import annotations

import asyncio
import json

import pytest

from infinite_llm.core.errors import InvalidRequest, NotFound
from infinite_llm.services.manager import NotLeader
from infinite_llm.services.manager.computes import ComputeInfo, ComputeLoad

from .helpers import make_servers, open_store, running_manager, wait_for


def _ids(manager) -> list[str]:
    return [m.info.instance_id for m in manager.computes.members.members()]


async def _state(manager, instance_id: str):
    (state,) = [c for c in await manager.compute_instances(include_debts=True) if c.info.instance_id == instance_id]
    return state


def test_instance_registers_under_its_lease_with_named_and_same_node_homes(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 4, "c": 4})
        async with running_manager(etcd_server, etcd_prefix, servers, register=False) as m:
            await m.register("a", "10.0.0.1:1", 4, 4, node_name="node-1")
            await m.register("b", "10.0.0.2:1", 4, 4, node_name="node-2")
            await m.register("c", "10.0.0.3:1", 4, 4)
            reg = await m.register_compute(ComputeInfo("c0", "10.0.1.1:50070", ("c",), "node-1"), ttl_s=5)
            assert _ids(m) == ["c0"] and reg.ttl_s == 5
            async with open_store(etcd_server, etcd_prefix) as raw:
                kv = await raw.get("computes/c0")
                assert kv.lease == reg.lease_id
                assert json.loads(kv.value) == {
                    "address": "10.0.1.1:50070",
                    "home_server_ids": ["c"],
                    "node_name": "node-1",
                }
                assert json.loads((await raw.get("members/a")).value)["node_name"] == "node-1"
                assert "node_name" not in json.loads((await raw.get("members/c")).value)
            state = await _state(m, "c0")
            assert state.homes == ("a", "c")  # named c, plus a on its node; b is on another node
            assert (state.load, state.debt_blocks) == (ComputeLoad(), 0)
            await m.heartbeat_compute("c0", ComputeLoad(3, 2, 170, heartbeat_at=1.0))
            assert (await _state(m, "c0")).load == ComputeLoad(3, 2, 170, 1.0)
            # A server joining that node later is a home from then on.
            await m.register("d", "10.0.0.4:1", 4, 4, node_name="node-1")
            assert (await _state(m, "c0")).homes == ("a", "c", "d")

    asyncio.run(scenario())


def test_instance_vanishes_after_ttl_once_heartbeats_stop_and_registers_again(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            info = ComputeInfo("c0", "127.0.0.1:50070", ("a",))
            await m.register_compute(info, ttl_s=2)

            async def heartbeats():
                while True:
                    await m.heartbeat_compute("c0", ComputeLoad(1, 0, 16))
                    await asyncio.sleep(0.5)

            beating = asyncio.create_task(heartbeats())
            await asyncio.sleep(3.0)  # 1.5 TTLs: alive only because of the heartbeats
            assert _ids(m) == ["c0"]
            beating.cancel()
            gone_after_s = await wait_for(lambda: _ids(m) == [], timeout_s=6)
            assert gone_after_s > 1.0  # the TTL removed it
            assert await m.compute_instances() == []
            with pytest.raises(NotFound, match="'c0'"):
                await m.heartbeat_compute("c0", ComputeLoad())
            # The restarted instance registers again, at its new address, with an empty load.
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50071", ("a",)), ttl_s=2)
            (state,) = await m.compute_instances()
            assert (state.info.address, state.load, state.debt_blocks) == ("127.0.0.1:50071", ComputeLoad(), None)

    asyncio.run(scenario())


def test_deregistered_instance_leaves_at_once_and_followers_see_it_through_their_watch(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as leader:
            async with running_manager(etcd_server, etcd_prefix, servers, "m2", register=False, lead=False) as follower:
                await leader.register_compute(ComputeInfo("c0", "127.0.0.1:50070"))
                await wait_for(lambda: _ids(follower) == ["c0"], timeout_s=5)
                with pytest.raises(NotLeader):
                    await follower.register_compute(ComputeInfo("c1", "127.0.0.1:50071"))
                await leader.deregister_compute("c0")
                assert _ids(leader) == []
                await wait_for(lambda: _ids(follower) == [], timeout_s=5)
                with pytest.raises(NotFound):
                    await leader.deregister_compute("c0")

    asyncio.run(scenario())


def test_debt_is_the_rblocks_of_its_sequences_on_servers_that_are_not_its_homes(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4, "b": 8})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070", ("a",)))
            await m.register_compute(ComputeInfo("c1", "127.0.0.1:50071", ("b",)))
            await m.place("s1", 6, near="a", owner="c0")  # a: 4 (home), b: 2 (borrowed)
            await m.place("s2", 3, near="b", owner="c1")  # b: 3 (home)
            await m.place("s3", 2, near="b")  # nobody's: counted for no instance
            await m.place("s1", 1, near="b", first_index=6)  # the owner stays c0: b now 3
            state = await m.cluster_state()
            assert state.ledger == {"s1": [("a", 4), ("b", 3)], "s2": [("b", 3)], "s3": [("b", 2)]}
            assert state.owners == {"s1": "c0", "s2": "c1"}
            assert [(c.info.instance_id, c.homes, c.debt_blocks) for c in state.computes] == [
                ("c0", ("a",), 3),
                ("c1", ("b",), 0),
            ]
            async with open_store(etcd_server, etcd_prefix) as raw:
                assert json.loads((await raw.get("ledger/s1")).value) == {"owner": "c0", "shares": [["a", 4], ["b", 3]]}
                assert json.loads((await raw.get("ledger/s3")).value) == [["b", 2]]
            assert [c.debt_blocks for c in await m.compute_instances()] == [None, None]  # not counted unless asked
            await m.release("s1")
            assert (await _state(m, "c0")).debt_blocks == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"instance_id": ""}, "instance_id"),
        ({"instance_id": "bad/id"}, "instance_id"),
        ({"address": ""}, "address"),
        ({"address": "no-port"}, "address"),
        ({"address": "host:99999"}, "address"),
        ({"home_server_ids": ("a", "")}, "home_server_ids"),
        ({"home_server_ids": ("a b",)}, "home_server_ids"),
        ({"node_name": "node/1"}, "node_name"),
    ],
)
def test_bad_registrations_are_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as e:
        ComputeInfo(**{"instance_id": "c0", "address": "127.0.0.1:1", **fields})
    assert e.value.param == param


def test_bad_heartbeats_are_refused_and_nothing_changes(etcd_server, etcd_prefix):
    async def scenario():
        servers = make_servers({"a": 4})
        async with running_manager(etcd_server, etcd_prefix, servers) as m:
            await m.register_compute(ComputeInfo("c0", "127.0.0.1:50070"))
            with pytest.raises(InvalidRequest) as e:
                await m.heartbeat_compute("", ComputeLoad())
            assert e.value.param == "instance_id"
            with pytest.raises(NotFound):
                await m.heartbeat_compute("c9", ComputeLoad())
            with pytest.raises(InvalidRequest) as e:
                ComputeLoad(num_running=-1)
            assert e.value.param == "num_running"
            with pytest.raises(InvalidRequest) as e:
                await m.place("s", 1, owner="bad owner")
            assert e.value.param == "instance_id"
            assert (await m.cluster_state()).ledger == {}

    asyncio.run(scenario())
