"""What the global manager keeps in etcd, the key layout, and the JSON codecs of the values.

Key layout (relative to the store prefix, default ``/infinite-llm/``):

- ``leader``              the leading manager's id, attached to its session lease (fencing token: its
                          ``mod_revision``).
- ``members/<server_id>`` a :class:`MemberInfo` as JSON, attached to the member's lease (vanishes with it).
- ``computes/<instance_id>`` a compute instance's :class:`~.computes.ComputeInfo` as JSON, under its own lease.
- ``ledger/<seq_id>``     the placement ledger of one sequence: JSON ``[[server_id, n_blocks], ...]``, or
                          ``{"owner": instance_id, "shares": [[server_id, n_blocks], ...]}`` when the
                          compute instance that placed it said who it is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.ids import check_id

if TYPE_CHECKING:
    from infinite_llm.services.manager.computes import ComputeState

LEADER_KEY = "leader"
MEMBERS_PREFIX = "members/"
COMPUTES_PREFIX = "computes/"
LEDGER_PREFIX = "ledger/"

LedgerEntries = list[tuple[str, int]]  # [(server_id, n_blocks)], one entry per server, first-placed first
InfoT = TypeVar("InfoT")


@dataclass(frozen=True)
class MemberInfo:
    """A registered server. ``capacity_blocks`` rBlocks of ``block_size`` tokens; ``kind`` e.g. "attention";
    ``node_name`` the machine it runs on ('' = not told), which makes it a home of compute instances there;
    ``identity`` the subject of the certificate it registered with ('' = plaintext), whom its id belongs to
    while its lease lives."""

    server_id: str
    address: str
    capacity_blocks: int
    block_size: int
    kind: str = "attention"
    node_name: str = ""
    identity: str = ""
    kv_layout: str = ""  # the KV it keeps, as ``rpc.kv_layout.kv_layout_text`` ('' = not told: an older server)

    def __post_init__(self) -> None:
        check_id("server_id", self.server_id)
        if self.node_name:
            check_id("node_name", self.node_name)
        if self.capacity_blocks < 0:
            raise InvalidRequest(f"capacity_blocks must be >= 0, got {self.capacity_blocks}")
        if self.block_size <= 0:
            raise InvalidRequest(f"block_size must be > 0, got {self.block_size}")

    def to_json(self) -> bytes:
        fields = asdict(self)
        del fields["server_id"]  # it is the key
        if not fields["node_name"]:
            del fields["node_name"]  # records of servers that were not told their node read as before
        for optional in ("identity", "kv_layout"):
            if not fields[optional]:
                del fields[optional]
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_json(cls, server_id: str, data: bytes) -> MemberInfo:
        # newer writers may add fields
        known = {"address", "capacity_blocks", "block_size", "kind", "node_name", "identity", "kv_layout"}
        return cls(server_id=server_id, **{k: v for k, v in json.loads(data).items() if k in known})


@dataclass(frozen=True)
class Member(Generic[InfoT]):
    """A live member as the manager sees it: its record (an attention server's :class:`MemberInfo`, a compute
    instance's ``ComputeInfo``) and the lease that keeps its key alive."""

    info: InfoT
    lease_id: int


@dataclass(frozen=True)
class Grant:
    """Part of a placement: ``n_blocks`` committed rBlocks (physical ``block_ids``) on ``server_id``."""

    server_id: str
    n_blocks: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class MemberState:
    """One member in :class:`ClusterState`: free rBlocks and load from the (possibly stale) view."""

    info: MemberInfo
    free_blocks: int
    load: float
    stale: bool


@dataclass(frozen=True)
class ClusterState:
    """Snapshot for operators and the GlobalManager's ClusterState RPC. ``ledger``: seq_id -> entries;
    ``owners``: seq_id -> the compute instance that placed it (sequences placed anonymously are absent);
    ``computes``: the live compute instances with their debts."""

    leader: str | None
    members: list[MemberState]
    ledger: dict[str, LedgerEntries]
    owners: dict[str, str] = field(default_factory=dict)
    computes: list[ComputeState] = field(default_factory=list)


def encode_ledger(entries: LedgerEntries, owner: str = "") -> bytes:
    shares = [[s, n] for s, n in entries]
    return json.dumps({"owner": owner, "shares": shares} if owner else shares).encode()


def decode_ledger(data: bytes) -> tuple[LedgerEntries, str]:
    """``(entries, owner)`` of a ledger value; ``owner`` is '' for a sequence placed anonymously."""
    value = json.loads(data)
    owner, shares = (str(value["owner"]), value["shares"]) if isinstance(value, dict) else ("", value)
    return [(str(s), int(n)) for s, n in shares], owner


def merge_ledger(old: LedgerEntries, added: LedgerEntries) -> LedgerEntries:
    """``old`` plus ``added``: counts of a server already present are summed; new servers go last."""
    merged = dict(old)
    for server_id, n in added:
        merged[server_id] = merged.get(server_id, 0) + n
    return list(merged.items())


def blocks_per_server(ledgers: dict[str, LedgerEntries]) -> dict[str, int]:
    """rBlocks the ledger places on each server, summed over sequences."""
    used: dict[str, int] = {}
    for entries in ledgers.values():
        for server_id, n in entries:
            used[server_id] = used.get(server_id, 0) + n
    return used
