"""Client-side helpers of the attention-server tests: a tiny compute instance over real stubs.

``Pair`` is one remote server and a local mirror ``RManager`` that receives the same placement and the same
step, so every partial the server returns has an in-process reference. ``Steps`` plays the compute
instance: block tables over several pairs, ``split_step`` per sequence, random q/k/v per layer, and the
dense causal attention every merged result must equal.
"""

from __future__ import annotations

import math

import torch

from infinite_llm.core.attention import merge_partials
from infinite_llm.core.dist_attention import SeqStepInput, split_step
from infinite_llm.core.rmanager import HolderSeqStep, KVLayout, RManager
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.rpc import codec

TIMEOUT = 10


def seq_attend(item: HolderSeqStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> pb.SeqAttend:
    """One sequence's request part: all its queries ``q [T, H, D]``, the K/V rows of ``k, v [T, Hkv, D]`` kept here."""
    msg = pb.SeqAttend(
        seq_id=item.seq_id,
        query_positions=item.query_positions,
        context_len=item.context_len,
        block_ids=item.block_ids,
        block_indices=item.block_indices,
        slot_mapping=item.slot_mapping,
    )
    codec.encode_tensor(q, msg.query)
    if item.slot_mapping:
        codec.encode_tensor(k[item.new_token_rows], msg.key)
        codec.encode_tensor(v[item.new_token_rows], msg.value)
    return msg


class Pair:
    """A remote attention server (``stub``) and its local mirror ``RManager`` with the same capacity."""

    def __init__(self, stub, num_blocks: int, layout: KVLayout, mirrored: bool = True) -> None:
        self.stub = stub
        self.mirror = RManager(num_blocks, layout) if mirrored else None

    def reserve_commit(self, seq_id: str, n: int) -> list[int]:
        r = self.stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id=seq_id, num_blocks=n), timeout=TIMEOUT)
        committed = self.stub.CommitBlocks(pb.CommitBlocksRequest(reservation_id=r.reservation_id), timeout=TIMEOUT)
        assert committed.seq_id == seq_id and list(committed.block_ids) == list(r.block_ids)
        if self.mirror is not None:
            assert self.mirror.allocate(seq_id, n) == list(r.block_ids)  # same free-list order on both
        return list(r.block_ids)

    def attend(self, layer: int, parts: list[tuple[HolderSeqStep, torch.Tensor, torch.Tensor, torch.Tensor]]):
        """Remote and mirror partials of ``parts`` [(item, q, k, v) per sequence]: two lists of (out, lse).

        Without a mirror the second list is the first (nothing to compare with).
        """
        request = pb.AttendStepRequest(layer=layer, seqs=[seq_attend(*p) for p in parts])
        reply = self.stub.AttendStep(request, timeout=TIMEOUT)
        remote = [(codec.decode_tensor(r.partial_out), codec.decode_tensor(r.lse)) for r in reply.partials]
        assert [r.seq_id for r in reply.partials] == [p[0].seq_id for p in parts]
        if self.mirror is None:
            return remote, remote
        plan = self.mirror.plan_step([p[0] for p in parts])
        q, k, v = (torch.cat([p[i] for p in parts]) for i in (1, 2, 3))
        out, lse = self.mirror.attend(layer, plan, q, k[plan.new_token_rows], v[plan.new_token_rows])
        counts = [p[1].shape[0] for p in parts]
        return remote, list(zip(out.split(counts), lse.split(counts), strict=True))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` at ``positions`` over all keys ``k, v [S, Hkv, D]`` -> ``[T, H, D]``."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)  # (S, H, D)
    scores = torch.einsum("thd,shd->hts", q.float(), kk) / math.sqrt(q.shape[2])
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]  # (T, S)
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, vv)


class Steps:
    """A compute instance in miniature: block tables over ``pairs`` and one step at a time."""

    def __init__(self, pairs: dict[str, Pair], layout: KVLayout, num_heads: int, seed: int = 0) -> None:
        self.pairs, self.layout, self.num_heads = pairs, layout, num_heads
        self.tables: dict[str, list[tuple[str, int]]] = {}
        self.kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # all K/V so far, for dense
        self.gen = torch.Generator().manual_seed(seed)

    def place(self, seq_id: str, servers: list[str]) -> None:
        """Block table entry ``i`` on ``servers[i]`` (reserved and committed in table order per server)."""
        ids = {s: iter(self.pairs[s].reserve_commit(seq_id, servers.count(s))) for s in dict.fromkeys(servers)}
        self.tables[seq_id] = [(s, next(ids[s])) for s in servers]

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.layout.dtype)

    def step(self, seqs: list[SeqStepInput], layer: int, check_dense: bool = True):
        """Run one layer of a step on every involved server; asserts remote == mirror (and == dense).

        Returns ``{server: [(out, lse) per sequence it serves]}`` of the remote partials.
        """
        lay, per_server, new_kv = self.layout, {}, {}
        for s in seqs:
            q = self._rand(s.num_new, self.num_heads, lay.head_dim)
            k, v = (self._rand(s.num_new, lay.num_kv_heads, lay.head_dim) for _ in range(2))
            new_kv[s.seq_id] = (q, k, v)
            for server, item in split_step(self.tables[s.seq_id], lay.block_size, s).items():
                per_server.setdefault(server, []).append((item, q, k, v))
        results = {}
        for server, parts in per_server.items():
            remote, mirror = self.pairs[server].attend(layer, parts)
            for (ro, rl), (mo, ml) in zip(remote, mirror, strict=True):
                torch.testing.assert_close(ro, mo, atol=1e-5, rtol=0)
                torch.testing.assert_close(rl, ml, atol=1e-5, rtol=0)
            results[server] = remote
        if check_dense:
            self._check_dense(seqs, layer, new_kv, per_server, results)
        return results

    def _check_dense(self, seqs, layer, new_kv, per_server, results) -> None:
        for s in seqs:
            q, k, v = new_kv[s.seq_id]
            old_k, old_v = self.kv.get((s.seq_id, layer), (k[:0], v[:0]))
            all_k, all_v = torch.cat([old_k, k]), torch.cat([old_v, v])
            self.kv[(s.seq_id, layer)] = (all_k, all_v)
            parts = [
                res[i] for srv, res in results.items() for i, p in enumerate(per_server[srv]) if p[0].seq_id == s.seq_id
            ]
            merged, _ = merge_partials(torch.stack([p[0].float() for p in parts]), torch.stack([p[1] for p in parts]))
            positions = list(range(s.num_computed, s.num_computed + s.num_new))
            tol = 1e-5 if self.layout.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(merged, dense_attention(q, all_k, all_v, positions), atol=tol, rtol=0)
