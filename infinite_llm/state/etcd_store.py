"""The process's one etcd client: an asyncio wrapper over ``aetcd`` with keys under a prefix.

Only one gRPC-based etcd client may be imported per process (ENV.md), so every etcd access goes through
:class:`EtcdStore`. It offers what the global manager needs (DESIGN.md §5): get / prefix-get / put /
delete, leases (grant, keep-alive task, revoke), transactions with compares on ``mod_revision`` /
``version`` (compare-and-swap), and prefix watches. Keys are strings relative to ``prefix``; values are
bytes. Every etcd failure is raised as :class:`Unavailable` (a lease etcd does not know as
:class:`NotFound`), so callers see only the project's typed errors. Given a ``TlsConfig``, it dials etcd
over mTLS with that certificate (aetcd itself dials plaintext only: :class:`_TlsClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.transactions as txn_ops
import aetcd.watcher
import grpc
from aetcd import utils as aetcd_utils

from infinite_llm.core.errors import NotFound, Unavailable
from infinite_llm.rpc.tls import TlsConfig

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/infinite-llm/"


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it. ``key`` is relative to the store's prefix; ``lease`` is 0 for none."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """A change of one key: ``put`` (created or updated) or ``delete`` (deleted or its lease expired)."""

    kind: Literal["put", "delete"]
    kv: KeyValue


@dataclass(frozen=True)
class Compare:
    """A transaction guard on one key: ``target`` of ``key`` equals ``value``.

    ``version == 0`` means "the key does not exist"; ``mod_revision`` is the revision of the key's last
    write, so a compare on it is a compare-and-swap against what was read.
    """

    key: str
    target: Literal["mod_revision", "version", "create_revision", "value"]
    value: int | bytes

    @classmethod
    def mod_revision(cls, key: str, revision: int) -> Compare:
        return cls(key, "mod_revision", revision)

    @classmethod
    def version(cls, key: str, version: int) -> Compare:
        return cls(key, "version", version)

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "version", 0)


@dataclass(frozen=True)
class Op:
    """A transaction operation: ``put`` (with an optional lease id), ``delete`` or ``get`` of one key."""

    kind: Literal["put", "delete", "get"]
    key: str
    value: bytes = b""
    lease_id: int | None = None

    @classmethod
    def put(cls, key: str, value: bytes, lease_id: int | None = None) -> Op:
        return cls("put", key, value, lease_id)

    @classmethod
    def delete(cls, key: str) -> Op:
        return cls("delete", key)

    @classmethod
    def get(cls, key: str) -> Op:
        return cls("get", key)


@dataclass(frozen=True)
class TxnResult:
    """Outcome of :meth:`EtcdStore.txn`. ``gets`` holds one entry per ``get`` op of the branch that ran."""

    succeeded: bool
    revision: int
    gets: list[KeyValue | None]


@dataclass(frozen=True)
class RangeResult:
    """Keys of a prefix read at store revision ``revision`` (watch from ``revision + 1`` to miss nothing)."""

    items: list[KeyValue]
    revision: int


_COMPARE_CLASSES = {
    "mod_revision": txn_ops.Mod,
    "version": txn_ops.Version,
    "create_revision": txn_ops.Create,
    "value": txn_ops.Value,
}


def _etcd_errors(fn):
    """Map aetcd / gRPC failures of an ``EtcdStore`` coroutine method to the project's typed errors."""

    @functools.wraps(fn)
    async def wrapper(self: EtcdStore, *args, **kwargs):
        try:
            return await fn(self, *args, **kwargs)
        except aetcd.exceptions.ClientError as e:
            # aetcd keeps the gRPC error as the cause; etcd answers NOT_FOUND only for a lease it does not know
            if isinstance(e.__cause__, grpc.RpcError) and e.__cause__.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"etcd lease not found ({fn.__name__})") from e
            raise Unavailable(f"etcd at {self.target} failed in {fn.__name__}: {e}") from e

    return wrapper


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel with a client certificate (etcd's ``--client-cert-auth``)."""

    def __init__(self, host: str, port: int, timeout: float, tls: TlsConfig) -> None:
        super().__init__(host=host, port=port, timeout=timeout)
        self._tls = tls

    async def connect(self) -> None:
        """Open the channel and its stubs (as ``aetcd.Client.connect``, without user/password auth)."""
        if self._connected.is_set():
            return
        options = [*self._options.items(), *self._tls.channel_options()]
        target = f"{self._host}:{self._port}"
        self.channel = aetcd.rpc.secure_channel(target, self._tls.channel_credentials(), options=options)
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout)
        self._connected.set()


class EtcdStore:
    """Async etcd access under ``prefix`` (default ``/infinite-llm/``), over one gRPC channel.

    Args:
        host, port: the etcd client endpoint.
        prefix: prepended to every key; must end with ``/``.
        timeout_s: per-request deadline in seconds.
        tls: dial over mTLS with this identity (``None``: plaintext). etcd serves the manager's
            certificate in a local mesh, so the channel checks the mesh's server name.

    Raises (every method): Unavailable when etcd cannot be reached or fails the request.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 2379,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 5.0,
        tls: TlsConfig | None = None,
    ) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/', got {prefix!r}")
        self.prefix = prefix
        self.target = f"{host}:{port}"
        if tls is None:
            self._client = aetcd.Client(host=host, port=port, timeout=timeout_s)
        else:
            self._client = _TlsClient(host, port, timeout_s, tls)

    # ---- connection ------------------------------------------------------------------------------
    @_etcd_errors
    async def connect(self) -> None:
        await self._client.connect()
        await self._client.status()  # fail now, not at first use, if etcd is not there

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- keys ------------------------------------------------------------------------------------
    def _full(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _kv(self, raw) -> KeyValue:
        key = raw.key.decode()
        return KeyValue(
            key[len(self.prefix) :] if key.startswith(self.prefix) else key,
            bytes(raw.value),
            raw.create_revision,
            raw.mod_revision,
            raw.version,
            raw.lease,
        )

    @_etcd_errors
    async def get(self, key: str) -> KeyValue | None:
        """The key, or ``None`` if absent."""
        got = await self._client.get(self._full(key))
        return None if got is None else self._kv(got)

    @_etcd_errors
    async def get_prefix(self, key_prefix: str) -> RangeResult:
        """Every key starting with ``key_prefix`` (sorted by key) and the store revision of the read."""
        got = await self._client.get_prefix(self._full(key_prefix), sort_order="ascend")
        return RangeResult([self._kv(kv) for kv in got.kvs], got.header.revision)

    @_etcd_errors
    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> int:
        """Write ``key`` unconditionally (attached to ``lease_id`` if given); returns the new revision.

        Raises:
            NotFound: ``lease_id`` is not a live lease.
        """
        return (await self._client.put(self._full(key), value, lease=lease_id)).header.revision

    @_etcd_errors
    async def delete(self, key: str) -> bool:
        """Delete ``key`` unconditionally; whether it existed."""
        return (await self._client.delete(self._full(key))) is not None

    @_etcd_errors
    async def delete_prefix(self, key_prefix: str) -> int:
        """Delete every key starting with ``key_prefix``; how many were deleted."""
        return (await self._client.delete_prefix(self._full(key_prefix))).deleted

    # ---- transactions ----------------------------------------------------------------------------
    @_etcd_errors
    async def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """One atomic etcd transaction: if every compare holds run ``success``, else ``failure``.

        Raises:
            NotFound: a put names a lease that is not live.
        """
        ok, responses = await self._client.transaction(
            compare=[self._compare(c) for c in compares],
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        )
        gets: list[KeyValue | None] = []
        revision = 0
        for resp in responses:
            if isinstance(resp, list):  # a get: [(value, Get)], empty if the key is absent
                gets.append(self._kv(resp[0][1]) if resp else None)
                revision = max(revision, resp[0][1].header.revision) if resp else revision
            elif resp.WhichOneof("response") == "response_put":
                revision = max(revision, resp.response_put.header.revision)
            elif resp.WhichOneof("response") == "response_delete_range":
                revision = max(revision, resp.response_delete_range.header.revision)
        return TxnResult(ok, revision, gets)

    def _compare(self, c: Compare):
        cmp = _COMPARE_CLASSES[c.target](self._full(c.key))
        return cmp == c.value

    def _op(self, o: Op):
        if o.kind == "put":
            return txn_ops.Put(self._full(o.key), o.value, lease=o.lease_id)
        if o.kind == "delete":
            return txn_ops.Delete(self._full(o.key))
        return txn_ops.Get(self._full(o.key))

    # ---- leases ----------------------------------------------------------------------------------
    @_etcd_errors
    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (etcd's minimum is ~2 s); returns its id."""
        return (await self._client.lease(int(ttl_s))).id

    @_etcd_errors
    async def refresh_lease(self, lease_id: int) -> int:
        """One keep-alive: resets the lease's TTL; returns it in seconds (0: the lease has expired)."""
        reply = await self._client.refresh_lease(lease_id)
        return 0 if reply is None else int(reply.TTL)

    @_etcd_errors
    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease now: every key attached to it is deleted.

        Raises:
            NotFound: the lease is not live (already revoked or expired).
        """
        await self._client.revoke_lease(lease_id)

    def keep_alive(
        self, lease_id: int, interval_s: float, on_lost: Callable[[], Awaitable[None] | None] | None = None
    ) -> asyncio.Task:
        """A task refreshing ``lease_id`` every ``interval_s`` seconds (use ~TTL/3) until cancelled.

        It ends, calling ``on_lost`` if given, once etcd reports the lease expired; a failed refresh (etcd
        briefly unreachable) is retried at the next interval. Cancel the task to stop keeping alive.
        """
        return asyncio.create_task(self._keep_alive(lease_id, interval_s, on_lost), name=f"keep-alive-{lease_id}")

    async def _keep_alive(self, lease_id: int, interval_s: float, on_lost) -> None:
        while True:
            try:
                ttl = await self.refresh_lease(lease_id)
            except Unavailable as e:
                log.warning("lease %x keep-alive failed, retrying: %s", lease_id, e)
                ttl = -1
            if ttl == 0:
                log.warning("lease %x expired", lease_id)
                if on_lost is not None:
                    result = on_lost()
                    if asyncio.iscoroutine(result):
                        await result
                return
            await asyncio.sleep(interval_s)

    # ---- watches ---------------------------------------------------------------------------------
    @_etcd_errors
    async def watch_prefix(
        self, key_prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> PrefixWatch:
        """Call ``callback`` for every change under ``key_prefix`` from ``start_revision`` on (inclusive).

        The watch is established when this returns; events arrive in revision order on a background task.
        ``callback`` runs in the event loop and must not block (an exception it raises is logged). If etcd
        goes away the watch ends: ``PrefixWatch.done`` completes; re-read and watch again. Stop it with
        ``PrefixWatch.cancel()``.
        """
        full = self._full(key_prefix)
        watch = await self._client.watch(
            full, range_end=aetcd_utils.prefix_range_end(full), start_revision=start_revision
        )
        return PrefixWatch(watch, asyncio.create_task(self._pump(watch, callback), name=f"watch-{key_prefix}"))

    async def _pump(self, watch, callback: Callable[[WatchEvent], None]) -> None:
        try:
            async for event in watch:
                kind = "put" if event.kind == "PUT" else "delete"
                try:
                    callback(WatchEvent(kind, self._kv(event.kv)))
                except Exception:
                    log.exception("watch callback failed on %s", event.kv.key)
        except aetcd.exceptions.ClientError as e:
            log.warning("etcd watch ended: %s", e)


class PrefixWatch:
    """A running prefix watch; :meth:`cancel` stops it. ``done`` is the event-delivery task."""

    def __init__(self, watch, task: asyncio.Task) -> None:
        self._watch = watch
        self.done = task

    async def cancel(self) -> None:
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await self._watch.cancel()
        self.done.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.done
