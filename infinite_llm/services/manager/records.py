"""What the global manager keeps in etcd, the key layout, and the JSON codecs of the values.

Key layout (relative to the store prefix, default ``/infinite-llm/``):

- ``leader``              the leading manager's id, attached to its session lease (fencing token: its
                          ``mod_revision``).
- ``members/<server_id>`` a :class:`MemberInfo` as JSON, attached to the member's lease (vanishes with it).
- ``ledger/<seq_id>``     the placement ledger of one sequence: JSON ``[[server_id, n_blocks], ...]``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.ids import check_id

LEADER_KEY = "leader"
MEMBERS_PREFIX = "members/"
LEDGER_PREFIX = "ledger/"

LedgerEntries = list[tuple[str, int]]  # [(server_id, n_blocks)], one entry per server, first-placed first


@dataclass(frozen=True)
class MemberInfo:
    """A registered server. ``capacity_blocks`` rBlocks of ``block_size`` tokens; ``kind`` e.g. "attention"."""

    server_id: str
    address: str
    capacity_blocks: int
    block_size: int
    kind: str = "attention"

    def __post_init__(self) -> None:
        check_id("server_id", self.server_id)
        if self.capacity_blocks < 0:
            raise InvalidRequest(f"capacity_blocks must be >= 0, got {self.capacity_blocks}")
        if self.block_size <= 0:
            raise InvalidRequest(f"block_size must be > 0, got {self.block_size}")

    def to_json(self) -> bytes:
        fields = asdict(self)
        del fields["server_id"]  # it is the key
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_json(cls, server_id: str, data: bytes) -> MemberInfo:
        known = {"address", "capacity_blocks", "block_size", "kind"}  # newer writers may add fields
        return cls(server_id=server_id, **{k: v for k, v in json.loads(data).items() if k in known})


@dataclass(frozen=True)
class Member:
    """A live member as the manager sees it: its record and the lease that keeps its key alive."""

    info: MemberInfo
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
    """Snapshot for operators and the GlobalManager's ClusterState RPC. ``ledger``: seq_id -> entries."""

    leader: str | None
    members: list[MemberState]
    ledger: dict[str, LedgerEntries]


def encode_ledger(entries: LedgerEntries) -> bytes:
    return json.dumps([[s, n] for s, n in entries]).encode()


def decode_ledger(data: bytes) -> LedgerEntries:
    return [(str(s), int(n)) for s, n in json.loads(data)]


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
