"""EtcdStore against a real etcd: prefixed keys, compare-and-swap, leases and keep-alive, prefix watches."""

from __future__ import annotations

import asyncio
import time

import pytest

from infinite_llm.core.errors import NotFound, Unavailable
from infinite_llm.state.etcd_launcher import free_port
from infinite_llm.state.etcd_store import Compare, EtcdStore, Op
from tests.etcd_server import open_store


async def _wait_for(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout_s`` seconds."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def test_keys_live_under_the_prefix_and_read_back_relative(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store, open_store(etcd_server, etcd_prefix + "x/") as other:
            await store.put("members/a", b"1")
            await store.put("members/b", b"2")
            await store.put("ledger/s", b"3")
            await other.put("members/a", b"elsewhere")
            got = await store.get_prefix("members/")
            assert [(kv.key, kv.value) for kv in got.items] == [("members/a", b"1"), ("members/b", b"2")]
            assert got.revision >= got.items[-1].mod_revision
            assert (await store.get("ledger/s")).value == b"3"
            assert await store.delete("ledger/s") is True
            assert await store.get("ledger/s") is None
            assert await store.delete("ledger/s") is False
            assert (await other.get("members/a")).value == b"elsewhere"

    asyncio.run(scenario())


def test_compare_and_swap_creates_once_and_detects_a_concurrent_write(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store:
            first = await store.txn([Compare.absent("k")], [Op.put("k", b"v1")], [Op.get("k")])
            assert first.succeeded and first.gets == []
            again = await store.txn([Compare.absent("k")], [Op.put("k", b"v2")], [Op.get("k")])
            assert not again.succeeded and again.gets[0].value == b"v1"
            read = await store.get("k")
            assert read.mod_revision == first.revision and read.version == 1
            await store.put("k", b"someone else")  # a concurrent writer
            stale = await store.txn(
                [Compare.mod_revision("k", read.mod_revision)], [Op.put("k", b"mine")], [Op.get("k")]
            )
            assert not stale.succeeded and stale.gets[0].value == b"someone else"
            fresh = stale.gets[0]
            ok = await store.txn([Compare.mod_revision("k", fresh.mod_revision)], [Op.put("k", b"mine")])
            assert ok.succeeded and (await store.get("k")).value == b"mine"

    asyncio.run(scenario())


def test_revoked_lease_takes_its_keys_and_cannot_be_used(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store:
            lease = await store.grant_lease(10)
            await store.put("leased", b"x", lease_id=lease)
            assert (await store.get("leased")).lease == lease
            await store.revoke_lease(lease)
            assert await store.get("leased") is None
            assert await store.refresh_lease(lease) == 0
            with pytest.raises(NotFound):
                await store.revoke_lease(lease)
            with pytest.raises(NotFound):
                await store.put("leased", b"x", lease_id=lease)

    asyncio.run(scenario())


def test_keep_alive_task_holds_a_short_lease_and_reports_its_loss(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store:
            lease = await store.grant_lease(2)
            await store.put("alive", b"x", lease_id=lease)
            lost = asyncio.Event()
            task = store.keep_alive(lease, interval_s=0.5, on_lost=lost.set)
            await asyncio.sleep(3.0)  # longer than the TTL
            assert (await store.get("alive")) is not None
            await store.revoke_lease(lease)  # as if it had expired
            await asyncio.wait_for(lost.wait(), timeout=2.0)
            assert task.done()

    asyncio.run(scenario())


def test_prefix_watch_delivers_puts_and_deletes_in_order(etcd_server, etcd_prefix):
    async def scenario():
        async with open_store(etcd_server, etcd_prefix) as store:
            events = []
            watch = await store.watch_prefix("members/", events.append)
            await store.put("members/a", b"1")
            await store.put("other", b"ignored")
            await store.delete("members/a")
            await _wait_for(lambda: len(events) == 2, timeout_s=5)
            assert [(e.kind, e.kv.key) for e in events] == [("put", "members/a"), ("delete", "members/a")]
            await watch.cancel()
            await store.put("members/b", b"2")
            await asyncio.sleep(0.2)
            assert len(events) == 2

    asyncio.run(scenario())


def test_unreachable_etcd_raises_unavailable():
    async def scenario():
        store = EtcdStore("127.0.0.1", free_port(), timeout_s=1.0)
        with pytest.raises(Unavailable, match="etcd at 127.0.0.1"):
            await store.connect()
        await store.close()

    asyncio.run(scenario())
