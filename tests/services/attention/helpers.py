"""Client-side helpers of the attention-server tests: the real compute-side corridor over real stubs.

``Pair`` is one remote server and a local mirror ``RManager`` that receives the same placement (same
logical indices), so every partial the server returns has an in-process reference. ``Steps`` plays the
compute instance with the real :class:`DistAttention` over the real :class:`GrpcTransport`: block tables
chosen by the test, random q/k/v per layer, each server's partial checked against its mirror, and the
merged output against dense causal attention.
"""

from __future__ import annotations

import math

import torch

from infinite_llm.core.dist_attention import BlockId, BlockRef, DistAttention, HolderId, LayerInput, Partial
from infinite_llm.core.local_transport import LocalTransport
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.services.compute.grpc_transport import GrpcTransport

TIMEOUT = 10


class Pair:
    """A remote attention server (``stub`` at ``address``) and its local mirror ``RManager``."""

    def __init__(self, stub, num_blocks: int, layout: KVLayout, mirrored: bool = True, address: str = "") -> None:
        self.stub = stub
        self.address = address
        self.mirror = RManager(num_blocks, layout) if mirrored else None

    def reserve_commit(self, seq_id: str, indices: list[int]) -> list[int]:
        """Reserve and commit ``len(indices)`` rBlocks of ``seq_id`` at logical ``indices``."""
        r = self.stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id=seq_id, num_blocks=len(indices)), timeout=TIMEOUT)
        request = pb.CommitBlocksRequest(reservation_id=r.reservation_id, block_indices=indices)
        committed = self.stub.CommitBlocks(request, timeout=TIMEOUT)
        assert committed.seq_id == seq_id and list(committed.block_ids) == list(r.block_ids)
        if self.mirror is not None:
            assert self.mirror.allocate(seq_id, indices) == list(r.block_ids)  # same free-list order on both
        return list(r.block_ids)


class TablePlacement:
    """Placement where the test chose each rBlock's server (``servers[seq_id][i]`` for index ``i``)."""

    def __init__(self, pairs: dict[str, Pair]) -> None:
        self.pairs = pairs
        self.servers: dict[str, list[str]] = {}
        self.num_total_blocks = self.num_free_blocks = 1 << 20

    def place(self, seq_id: str, n: int, first_index: int, near: HolderId | None = None) -> list[BlockRef]:
        chosen = self.servers[seq_id][first_index : first_index + n]
        ids = {
            s: iter(self.pairs[s].reserve_commit(seq_id, [first_index + i for i, c in enumerate(chosen) if c == s]))
            for s in dict.fromkeys(chosen)
        }
        return [BlockRef(HolderId(s), BlockId(next(ids[s]))) for s in chosen]

    def release(self, seq_id: str, holders) -> int:  # noqa: ANN001
        return sum(
            self.pairs[h].stub.FreeSequence(pb.FreeSequenceRequest(seq_id=seq_id), timeout=TIMEOUT).num_freed
            for h in holders
        )


class CheckedTransport:
    """The gRPC transport, plus the same step on the mirrors: every remote partial must equal its mirror's."""

    def __init__(self, pairs: dict[str, Pair]) -> None:
        self.pairs = pairs
        self.remote = GrpcTransport(lambda s: pairs[s].address, timeout_s=TIMEOUT)
        self.mirror = LocalTransport({HolderId(s): p.mirror for s, p in pairs.items() if p.mirror is not None})
        self.partials: dict[int, dict[HolderId, Partial]] = {}  # layer -> server -> remote partial, last step

    def open_step(self, step_id, plans, num_heads, num_kv_rows=None) -> None:  # noqa: ANN001
        self.partials = {}
        self.remote.open_step(step_id, plans, num_heads, num_kv_rows)
        self.mirror.open_step(step_id, {h: s for h, s in plans.items() if h in self.mirror.holders}, num_heads)

    def attend(self, step_id: int, layer: int, inputs: dict[HolderId, LayerInput]) -> dict[HolderId, Partial]:
        remote = self.remote.attend(step_id, layer, inputs)
        mirrored = {h: x for h, x in inputs.items() if h in self.mirror.holders}
        for h, (out, lse) in self.mirror.attend(step_id, layer, mirrored).items():
            torch.testing.assert_close(remote[h][0], out, atol=1e-5, rtol=0)
            torch.testing.assert_close(remote[h][1], lse, atol=1e-5, rtol=0)
        self.partials[layer] = remote
        return remote

    def close_step(self, step_id: int, failed: bool) -> None:
        self.remote.close_step(step_id, failed)
        self.mirror.close_step(step_id, failed)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` at ``positions`` over all keys ``k, v [S, Hkv, D]`` -> ``[T, H, D]``."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)  # (S, H, D)
    scores = torch.einsum("thd,shd->hts", q.float(), kk) / math.sqrt(q.shape[2])
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]  # (T, S)
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, vv)


class Steps:
    """A compute instance in miniature: the real DistAttention over ``pairs``, one whole step at a time."""

    def __init__(self, pairs: dict[str, Pair], layout: KVLayout, num_heads: int, seed: int = 0) -> None:
        self.pairs, self.layout, self.num_heads = pairs, layout, num_heads
        self.placement = TablePlacement(pairs)
        self.transport = CheckedTransport(pairs)
        self.dist = DistAttention(self.placement, self.transport, layout.block_size)
        self.kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # all K/V so far, for dense
        self.gen = torch.Generator().manual_seed(seed)

    def place(self, seq_id: str, servers: list[str]) -> None:
        """Block table entry ``i`` on ``servers[i]`` (logical index ``i``)."""
        self.placement.servers[seq_id] = list(servers)
        assert self.dist.try_allocate(seq_id, len(servers))

    @property
    def tables(self) -> dict[str, list[BlockRef]]:
        return {s: self.dist.block_table(s) for s in self.placement.servers}

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.layout.dtype)

    def step(self, seqs: list[SeqStep], check_dense: bool = True) -> dict[int, dict[HolderId, Partial]]:
        """Run every layer of one step; asserts remote == mirror per server and merged == dense.

        Returns ``{layer: {server: (out, lse)}}`` of the remote partials (rows: the step's queries it saw).
        """
        lay, t = self.layout, sum(s.num_new for s in seqs)
        with self.dist.prepare(seqs, self.num_heads) as attention:
            for layer in range(lay.num_layers):
                q = self._rand(t, self.num_heads, lay.head_dim)
                k, v = (self._rand(t, lay.num_kv_heads, lay.head_dim) for _ in range(2))
                out = attention(layer, q, k, v)
                if check_dense:
                    self._check_dense(seqs, layer, q, k, v, out)
        return self.transport.partials

    def _check_dense(self, seqs, layer, q, k, v, out) -> None:  # noqa: ANN001
        start = 0
        for s in seqs:
            rows = slice(start, start + s.num_new)
            old_k, old_v = self.kv.get((s.seq_id, layer), (k[:0], v[:0]))
            all_k, all_v = torch.cat([old_k, k[rows]]), torch.cat([old_v, v[rows]])
            self.kv[(s.seq_id, layer)] = (all_k, all_v)
            positions = list(range(s.num_computed_tokens, s.context_len))
            tol = 1e-5 if self.layout.dtype == torch.float32 else 2e-2
            want = dense_attention(q[rows], all_k, all_v, positions)
            torch.testing.assert_close(out[rows].float(), want, atol=tol, rtol=0)
            start += s.num_new
