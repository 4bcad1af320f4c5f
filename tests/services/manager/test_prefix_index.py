"""The cluster's prefix-cache index in etcd: longest prefix on live servers, fenced writes, a new leader
reloads it, a lost server's entries go."""

from __future__ import annotations

import asyncio

import pytest

from infinite_llm.core.prefix_cache import block_hashes
from infinite_llm.services.manager import NotLeader
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.prefix_index import PREFIX_INDEX_PREFIX, PrefixIndex

from .helpers import open_store

H = block_hashes(list(range(16)), 4, "m")  # 4 chained block hashes


def test_index_serves_the_longest_live_prefix_survives_a_new_leader_and_drops_a_lost_server(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store:
            lead = Leadership(store, "m1", 5)
            await lead.acquire(5)
            index = PrefixIndex(store, lead)
            assert await index.add([(H[0], "a"), (H[1], "b"), (H[3], "a")]) == [H[0], H[1], H[3]]
            assert await index.add([(H[0], "b"), (H[2], "b")]) == [H[2]]  # one copy per hash
            assert index.longest_prefix(H, {"a", "b"}) == ["a", "b", "b", "a"]
            assert index.longest_prefix(H, {"a"}) == ["a"]  # b is not live: the chain stops there
            assert index.longest_prefix(block_hashes(list(range(1, 17)), 4, "m"), {"a", "b"}) == []
            assert (await store.get(PREFIX_INDEX_PREFIX + H[1].hex())).value == b"b"

            reloaded = PrefixIndex(store, lead)
            assert await reloaded.load() == 4 and reloaded.blocks_per_server() == {"a": 2, "b": 2}
            assert await reloaded.drop_server("b") == 2
            assert reloaded.longest_prefix(H, {"a", "b"}) == ["a"]
            assert await reloaded.remove([H[0], H[0], H[2]]) == 1
            assert (await store.get_prefix(PREFIX_INDEX_PREFIX)).items[0].key == PREFIX_INDEX_PREFIX + H[3].hex()

            await lead.close(resign=True)
            with pytest.raises(NotLeader):
                await reloaded.add([(H[0], "a")])
            assert len((await store.get_prefix(PREFIX_INDEX_PREFIX)).items) == 1  # nothing written

    asyncio.run(scenario())
