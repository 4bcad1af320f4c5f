"""Plain dataclasses between the attention servicer and its holder: no protobuf crosses this line."""

from __future__ import annotations

from dataclasses import dataclass

from infinite_llm.core.rmanager import StepPlan


@dataclass(frozen=True)
class ServerStep:
    """A step opened on this server: its plan (built once) and the query head count every layer must use."""

    plan: StepPlan
    num_heads: int


@dataclass(frozen=True)
class HolderStats:
    """Occupancy in rBlocks; bytes follow from ``bytes_per_block``."""

    num_blocks: int
    num_free: int
    num_used: int
    num_reserved: int
    num_sequences: int
    bytes_per_block: int
    num_cached: int = 0  # rBlocks in the prefix cache (read or parked; parked ones count in num_free)

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_block
