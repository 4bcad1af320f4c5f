"""Helpers for global-manager tests: real rManagers as attention servers, a started manager."""

from __future__ import annotations

import asyncio
import contextlib
import time

from infinite_llm.core.rmanager import KVLayout, RManager
from infinite_llm.services.manager import GlobalManager, LocalServers, ManagerConfig
from tests.etcd_server import open_store

# Tiny KV memory: the manager only does bookkeeping, the bytes do not matter.
LAYOUT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)


def make_servers(blocks: dict[str, int]) -> LocalServers:
    """One real rManager per server id, with ``blocks[server_id]`` rBlocks."""
    return LocalServers({sid: RManager(n, LAYOUT) for sid, n in blocks.items()})


def pool_state(servers: LocalServers) -> dict[str, tuple]:
    """Per server: (sorted free block ids, reserved count, owned blocks per sequence)."""
    return {
        sid: (sorted(rm.pool.free_block_ids()), rm.pool.num_reserved, {s: rm.owned_blocks(s) for s in rm.sequences()})
        for sid, rm in servers.rmanagers.items()
    }


@contextlib.asynccontextmanager
async def running_manager(etcd, prefix, servers, manager_id="m1", register=True, lead=True, **config):
    """A started GlobalManager (leader unless ``lead`` is False) with every server registered."""
    async with open_store(etcd, prefix) as store:
        config.setdefault("block_size", LAYOUT.block_size)
        manager = GlobalManager(store, servers, ManagerConfig(manager_id, **config))
        await manager.start(acquire_timeout_s=10 if lead else None)
        try:
            if register:
                for sid, rm in servers.rmanagers.items():
                    await manager.register(sid, f"{sid}.local:50051", rm.pool.num_blocks, LAYOUT.block_size)
            yield manager
        finally:
            await manager.stop()


async def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout_s`` seconds."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def manager_process_config(etcd, prefix, port: int, **overrides):  # noqa: ANN001, ANN201
    """A ``serve()`` config of a manager on ``port`` (id ``m-PORT``) over the test etcd, for tests that run
    whole manager processes' loops in this one."""
    from infinite_llm.services.manager.server import ManagerServerConfig

    fields = dict(
        etcd=f"{etcd.host}:{etcd.client_port}",
        port=port,
        manager_id=f"m-{port}",
        prefix=prefix,
        member_ttl_s=3,
        block_size=LAYOUT.block_size,
    )
    return ManagerServerConfig(**{**fields, **overrides})
