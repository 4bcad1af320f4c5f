"""Plain dataclasses between the attention servicer and its holder: no protobuf crosses this line."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqAttendParams:
    """One sequence's share of an AttendStep on this server (``core.rmanager.HolderSeqStep`` + tensors).

    Attributes:
        query: ``[num_query_tokens, num_heads, head_dim]`` in the layout dtype, RoPE applied (read-only).
        query_positions: ``[num_query_tokens]`` token positions of the queries.
        context_len: tokens whose KV exists after the step.
        block_ids / block_indices: this server's rBlocks of the sequence and their logical indices.
        slot_mapping: ``[num_new_here]`` slots of the new tokens stored here.
        key / value: ``[num_new_here, num_kv_heads, head_dim]`` or ``None`` when ``num_new_here == 0``.
    """

    seq_id: str
    query: torch.Tensor
    query_positions: list[int]
    context_len: int
    block_ids: list[int]
    block_indices: list[int]
    slot_mapping: list[int]
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


@dataclass(frozen=True)
class SeqPartialResult:
    """One sequence's partial attention on this server.

    ``partial_out [num_query_tokens, num_heads, head_dim]`` in the query dtype; ``lse [num_query_tokens,
    num_heads]`` fp32, natural log (``-inf`` where a query sees no key here).
    """

    seq_id: str
    partial_out: torch.Tensor
    lse: torch.Tensor


@dataclass(frozen=True)
class HolderStats:
    """Occupancy in rBlocks; bytes follow from ``bytes_per_block``."""

    num_blocks: int
    num_free: int
    num_used: int
    num_reserved: int
    num_sequences: int
    bytes_per_block: int

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_block
