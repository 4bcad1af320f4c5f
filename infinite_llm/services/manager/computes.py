"""Compute instances in the cluster view: leased registration, load heartbeats, homes and debts.

A compute instance registers ``computes/<instance_id>`` under its own lease (the same :class:`LeasedMembers`
mechanism as the attention servers, DESIGN.md §5) and heartbeats its batch size, queue and the tokens its
running sequences hold. Its **homes** are the attention servers on its own node (PAPER.md "Cluster
scheduling"): the ones it names, plus those registered with its node name. Its **debt** is the rBlocks of
its sequences (ledger owner = it) held on servers that are not its homes: memory it borrows. The router
follows :meth:`ComputeInstances.states` to know where to send requests.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from infinite_llm.core.errors import InvalidRequest, PermissionDenied
from infinite_llm.core.ids import check_id
from infinite_llm.services.manager.leadership import Leadership
from infinite_llm.services.manager.ledger import LedgerRecord
from infinite_llm.services.manager.membership import LeasedMembers, Registration, check_caller_address
from infinite_llm.services.manager.records import COMPUTES_PREFIX, MemberInfo
from infinite_llm.state.etcd_store import EtcdStore

log = logging.getLogger(__name__)
# A registration of a live id at another address is refused while the registered instance's last heartbeat
# is younger than this many heartbeat intervals (a third of its TTL each): it is alive, the caller a duplicate.
LIVE_HEARTBEAT_INTERVALS = 2


def check_address(address: str) -> str:
    """``address`` if it is ``HOST:PORT`` with a port in 1..65535; else InvalidRequest (param ``address``)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in address):
        raise InvalidRequest(f"address must be HOST:PORT, got {address[:64]!r}", param="address")
    return address


@dataclass(frozen=True)
class ComputeInfo:
    """A registered compute instance: where the router reaches it, and how its homes are named.
    ``identity``: the subject of the certificate it registered with ('' = plaintext), whom its id belongs
    to while its lease lives."""

    instance_id: str
    address: str
    home_server_ids: tuple[str, ...] = ()
    node_name: str = ""
    identity: str = ""
    kv_layout: str = ""  # the KV its model and dtype need, as ``rpc.kv_layout.kv_layout_text`` ('' = not told)

    def __post_init__(self) -> None:
        check_id("instance_id", self.instance_id)
        check_address(self.address)
        for server_id in self.home_server_ids:
            check_id("home_server_ids", server_id)
        if self.node_name:
            check_id("node_name", self.node_name)

    def to_json(self) -> bytes:
        value = {"address": self.address, "home_server_ids": list(self.home_server_ids), "node_name": self.node_name}
        if self.identity:  # records of plaintext instances read as before
            value["identity"] = self.identity
        if self.kv_layout:
            value["kv_layout"] = self.kv_layout
        return json.dumps(value, sort_keys=True).encode()

    @classmethod
    def from_json(cls, instance_id: str, data: bytes) -> ComputeInfo:
        value = json.loads(data)
        homes = tuple(value.get("home_server_ids", ()))
        node, identity, kv = value.get("node_name", ""), value.get("identity", ""), value.get("kv_layout", "")
        return cls(instance_id, value["address"], homes, node, identity, kv)

    def homes(self, servers: Iterable[MemberInfo]) -> tuple[str, ...]:
        """The named homes plus the live attention servers on this instance's node, sorted."""
        on_node = {s.server_id for s in servers if self.node_name and s.node_name == self.node_name}
        return tuple(sorted(set(self.home_server_ids) | on_node))


@dataclass(frozen=True)
class ComputeLoad:
    """An instance's last heartbeat: sequences running (batch size) and waiting (queue), tokens whose KV
    they hold, and when it came (``time.monotonic()`` seconds; ``None`` before the first)."""

    num_running: int = 0
    num_waiting: int = 0
    num_tokens_held: int = 0
    heartbeat_at: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "num_tokens_held"):
            if getattr(self, name) < 0:
                raise InvalidRequest(f"{name} must be >= 0, got {getattr(self, name)}", param=name)


@dataclass(frozen=True)
class ComputeState:
    """One live instance in the cluster view. ``debt_blocks`` is ``None`` where debts were not counted."""

    info: ComputeInfo
    homes: tuple[str, ...]
    load: ComputeLoad
    debt_blocks: int | None = None


def debts(records: Iterable[LedgerRecord], homes: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """rBlocks each instance of ``homes`` (instance id -> its home server ids) holds away from home.

    Counts the ledger ``records`` the instance owns, on every server not among its homes (an instance with
    no homes owes every rBlock it holds). Sequences of other or unnamed owners are not counted.
    """
    owed = dict.fromkeys(homes, 0)
    for record in records:
        if record.owner in owed:
            home = homes[record.owner]
            owed[record.owner] += sum(n for server_id, n in record.entries if server_id not in home)
    return owed


class ComputeInstances:
    """The live compute instances (``computes/`` in etcd, watch-fed) and their last heartbeats (in memory)."""

    def __init__(
        self, store: EtcdStore, leadership: Leadership, default_ttl_s: int = 10, lease_grace_s: int = 0
    ) -> None:
        """``default_ttl_s``, ``lease_grace_s``: as for :class:`~.membership.LeasedMembers`."""
        self._loads: dict[str, ComputeLoad] = {}
        self.members = LeasedMembers(
            store,
            leadership,
            COMPUTES_PREFIX,
            "instance_id",
            lambda info: info.instance_id,
            ComputeInfo.from_json,
            self._joined,
            self._left,
            default_ttl_s,
            lease_grace_s,
            "compute instance",
        )

    async def start(self) -> None:
        await self.members.start()

    async def stop(self) -> None:
        await self.members.stop()

    async def register(self, info: ComputeInfo, ttl_s: int) -> Registration:
        """Write ``computes/<instance_id>`` under a new lease (fenced); its load starts empty.

        Raises:
            NotLeader: this manager does not lead.
        """
        self._loads.pop(info.instance_id, None)
        return await self.members.register(info, ttl_s)

    async def heartbeat(self, instance_id: str, load: ComputeLoad) -> int:
        """Refresh the instance's lease and record ``load``; returns its TTL in seconds.

        Raises:
            InvalidRequest: a malformed id.
            NotFound: the instance is unknown or its lease expired (it must register again).
        """
        ttl = await self.members.keep_alive(instance_id)
        self._loads[instance_id] = load
        return ttl

    async def deregister(self, instance_id: str) -> None:
        """Remove the instance now (its lease is revoked). Raises NotFound if it is not registered."""
        await self.members.deregister(instance_id)

    def states(self, servers: Iterable[MemberInfo], owed: dict[str, int] | None = None) -> list[ComputeState]:
        """Live instances by id with their homes among ``servers`` (live attention servers), their last
        load, and their debt from ``owed`` (instance id -> rBlocks; ``None``: not counted)."""
        servers = list(servers)
        return [
            ComputeState(
                m.info,
                m.info.homes(servers),
                self._loads.get(m.info.instance_id, ComputeLoad()),
                None if owed is None else owed.get(m.info.instance_id, 0),
            )
            for m in self.members.members()
        ]

    def check_owner(self, instance_id: str, identity: str, address: str = "") -> None:
        """Raises ``PermissionDenied`` when ``instance_id`` is registered live by another certificate subject
        than ``identity``, or (``address`` told; '' = an older instance: not checked) at another address: an
        instance's id, load and sequences are its own while its lease lives, and every compute instance
        shares one certificate."""
        live = self._live(instance_id)
        if live is not None and live.identity != identity:
            raise PermissionDenied(
                f"compute instance {instance_id[:64]!r} is registered by another identity; it may register again "
                "when that registration's lease ends",
                param="instance_id",
            )
        if live is not None:
            check_caller_address(f"compute instance {instance_id[:64]!r}", live.address, address, "instance_id")

    def check_takeover(self, info: ComputeInfo, now: float | None = None) -> None:
        """Raises ``PermissionDenied`` when ``info`` would take over a registration of its id at another
        address whose instance still heartbeats (its last heartbeat under ``LIVE_HEARTBEAT_INTERVALS`` of its
        interval old): a second process under a live id. An instance restarted at a new address (the old
        process died: its heartbeats stopped) registers again, as before, once they are that late.

        Two processes under one id would heartbeat alternately, each listing only its own sequences, and the
        orphan reconciler would free the other's running sequences' rBlocks."""
        live = self._live(info.instance_id)
        load = self._loads.get(info.instance_id)
        if live is None or live.address == info.address or load is None or load.heartbeat_at is None:
            return
        window_s = LIVE_HEARTBEAT_INTERVALS * self.members.ttl_of(info.instance_id) / 3
        age_s = heartbeat_age_s(load, now)
        if age_s < window_s:
            raise PermissionDenied(
                f"compute instance {info.instance_id[:64]!r} is live at {live.address} (its last heartbeat "
                f"{age_s:.1f} s ago): a second instance under its id is refused; give each its own --instance-id "
                f"(a restart at a new address registers once the old one's heartbeats are {window_s:.0f} s late)",
                param="instance_id",
            )

    def _live(self, instance_id: str) -> ComputeInfo | None:
        return next((m.info for m in self.members.members() if m.info.instance_id == instance_id), None)

    def _joined(self, instance_id: str, info: ComputeInfo) -> None:
        homes, node = ", ".join(info.home_server_ids) or "-", info.node_name or "-"
        log.info("compute instance %s at %s (named homes %s, node %s)", instance_id, info.address, homes, node)

    def _left(self, instance_id: str) -> None:
        self._loads.pop(instance_id, None)


def heartbeat_age_s(load: ComputeLoad, now: float | None = None) -> float:
    """Seconds since ``load`` arrived; -1.0 when no heartbeat has come yet."""
    if load.heartbeat_at is None:
        return -1.0
    return max((time.monotonic() if now is None else now) - load.heartbeat_at, 0.0)
