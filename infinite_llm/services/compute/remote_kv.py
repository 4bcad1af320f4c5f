"""The compute instance's KV backend: rBlocks on remote attention servers, placed by the global manager.

Implements the engine's ``KVBackend`` (block manager + attention) over gRPC: ``try_allocate`` asks the
manager to place (reserve, record in the ledger, commit) new rBlocks; ``prepare`` cuts a step per server
with the same ``split_step`` as the single-process engine; the attention callable sends one batched
``AttendStep`` per involved server and layer, concurrently, and merges the partials exactly
(DESIGN.md §3). Sync gRPC: it runs on the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import torch

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.core.dist_attention import PartialsBuffer, SeqStepInput, split_step
from infinite_llm.core.errors import CapacityExhausted, InvalidRequest
from infinite_llm.core.model import AttentionFn
from infinite_llm.core.rmanager import HolderSeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.codec import decode_tensor, encode_tensor

CAPACITY_REFRESH_S = 1.0  # how stale the cluster's capacity view may be before it is read again (seconds)


class RemoteKV:
    """Block tables of this instance's sequences over the cluster's attention servers."""

    def __init__(
        self,
        manager_address: str,
        block_size: int,
        timeout_s: float = 30.0,
        on_rpc: Callable[[str, float], None] | None = None,
    ) -> None:
        """``on_rpc(server_id, seconds)`` is told the duration of every AttendStep call (metrics)."""
        self.block_size = block_size
        self._on_rpc = on_rpc
        self.timeout_s = timeout_s
        self._manager = mgrpc.GlobalManagerStub(sync_channel(manager_address))
        self._stubs: dict[str, agrpc.AttentionServerStub] = {}
        self._addresses: dict[str, str] = {}
        self._tables: dict[str, list[tuple[str, int]]] = {}
        self._capacity = (0, 0, 0.0)  # (total, free, read at monotonic time)
        self._lock = threading.Lock()
        self._released: dict[str, dict[str, int]] = {}
        self.rpc_seconds: dict[str, float] = {}  # time in AttendStep per server, for stats and benchmarks
        self.layer_rpc_seconds = 0.0  # wall time of every per-layer fan-out (seconds)
        self.layer_rpc_count = 0

    # ---- block manager ----------------------------------------------------------------------------
    def _cluster(self) -> tuple[int, int]:
        total, free, at = self._capacity
        if time.monotonic() - at > CAPACITY_REFRESH_S:
            state = self._call(self._manager.GetClusterState, mpb.ClusterStateRequest())
            good = [s for s in state.servers if s.block_size == self.block_size]
            total = sum(s.capacity_blocks for s in good)
            free = sum(s.free_blocks for s in good)
            self._capacity = (total, free, time.monotonic())
        return total, free

    @property
    def num_total_blocks(self) -> int:
        return self._cluster()[0]

    @property
    def num_free_blocks(self) -> int:
        return self._cluster()[1]

    def try_allocate(self, seq_id: str, n: int) -> bool:
        """Place ``n`` more rBlocks for ``seq_id``; False when the cluster cannot hold them now."""
        try:
            reply = self._manager.Place(mpb.PlaceRequest(seq_id=seq_id, num_blocks=n), timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._capacity = (self._capacity[0], 0, 0.0)  # re-read the view next time
                return False
            raise error_from_rpc(e) from None
        table = self._tables.setdefault(seq_id, [])
        for g in reply.grants:
            self._addresses[g.server_id] = g.address
            table.extend((g.server_id, int(b)) for b in g.block_ids)
        if sum(len(g.block_ids) for g in reply.grants) != n:
            raise CapacityExhausted(f"manager placed a wrong number of rBlocks for {seq_id!r}")
        return True

    def free(self, seq_id: str) -> int:
        """Release every rBlock of ``seq_id`` (the manager frees them on the servers and drops the ledger)."""
        with self._lock:
            self._released[seq_id] = self.placement(seq_id)
            while len(self._released) > 1024:  # nobody asked for these: keep the record bounded
                self._released.pop(next(iter(self._released)))
        n = len(self._tables.pop(seq_id, []))
        if n == 0:
            return 0  # never placed: nothing in the ledger
        try:
            self._manager.Release(mpb.ReleaseRequest(seq_id=seq_id), timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: already released
                raise error_from_rpc(e) from None
        self._capacity = (self._capacity[0], self._capacity[1] + n, self._capacity[2])
        return n

    def pop_placement(self, seq_id: str) -> dict[str, int]:
        """rBlocks per server of ``seq_id``, live or at its last release (then forgotten). Thread-safe."""
        with self._lock:
            released = self._released.pop(seq_id, None)
        return released if released is not None else self.placement(seq_id)

    def block_table(self, seq_id: str) -> list[tuple[str, int]]:
        return list(self._tables.get(seq_id, []))

    def placement(self, seq_id: str) -> dict[str, int]:
        """rBlocks per server of ``seq_id``."""
        out: dict[str, int] = {}
        for server, _ in self._tables.get(seq_id, []):
            out[server] = out.get(server, 0) + 1
        return out

    # ---- attention ---------------------------------------------------------------------------------
    def prepare(self, seqs: list[SeqStepInput]) -> AttentionFn:
        per_server: dict[str, list[tuple[HolderSeqStep, list[int]]]] = {}
        start = 0
        for s in seqs:
            rows = list(range(start, start + s.num_new))
            for server, item in split_step(self._tables.get(s.seq_id, []), self.block_size, s).items():
                per_server.setdefault(server, []).append((item, rows))
            start += s.num_new
        return lambda layer, q, k, v: self._attend(layer, per_server, q, k, v)

    def _attend(self, layer: int, per_server, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One ``AttendStep`` per server, concurrently; merge. ``q [T, H, D]``, ``k, v [T, Hkv, D]``."""
        fan_out_start = time.perf_counter()
        futures = []
        for server, items in per_server.items():
            req = apb.AttendStepRequest(layer=layer, seqs=[_seq_attend(it, rows, q, k, v) for it, rows in items])
            futures.append(
                (server, items, time.perf_counter(), self._stub(server).AttendStep.future(req, timeout=self.timeout_s))
            )
        partials = PartialsBuffer(len(futures), q)
        for j, (server, items, started, fut) in enumerate(futures):
            try:
                reply = fut.result()
            except grpc.RpcError as e:
                raise error_from_rpc(e) from None
            took = time.perf_counter() - started
            self.rpc_seconds[server] = self.rpc_seconds.get(server, 0.0) + took
            if self._on_rpc is not None:
                self._on_rpc(server, took)
            for (_, rows), part in zip(items, reply.partials, strict=True):
                idx = torch.tensor(rows, dtype=torch.int64, device=q.device)
                out = decode_tensor(part.partial_out, field="partial_out")
                partials.put(j, idx, out, decode_tensor(part.lse, field="lse"))
        self.layer_rpc_seconds += time.perf_counter() - fan_out_start
        self.layer_rpc_count += 1
        return partials.merged()

    def _stub(self, server: str) -> agrpc.AttentionServerStub:
        with self._lock:
            if server not in self._stubs:
                address = self._addresses.get(server)
                if address is None:
                    raise InvalidRequest(f"no address known for attention server {server!r}")
                self._stubs[server] = agrpc.AttentionServerStub(sync_channel(address))
            return self._stubs[server]

    def _call(self, method, request):  # noqa: ANN001, ANN202
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None


def _seq_attend(item: HolderSeqStep, rows: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN202
    """The wire form of one sequence's share: all its queries, and the K/V of its new tokens stored there."""
    sel = torch.tensor(rows, dtype=torch.int64)
    msg = apb.SeqAttend(
        seq_id=item.seq_id,
        query=encode_tensor(q[sel].cpu()),
        query_positions=item.query_positions,
        context_len=item.context_len,
        block_ids=item.block_ids,
        block_indices=item.block_indices,
        slot_mapping=item.slot_mapping,
    )
    if item.new_token_rows:
        new = sel[torch.tensor(item.new_token_rows, dtype=torch.int64)]
        msg.key.CopyFrom(encode_tensor(k[new].cpu()))
        msg.value.CopyFrom(encode_tensor(v[new].cpu()))
    return msg
