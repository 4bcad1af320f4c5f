"""The compute instance's KV backend: DistAttention over remote attention servers, placed by the manager.

:class:`ManagerPlacement` is DistAttention's :class:`~infinite_llm.core.dist_attention.Placement` over the
global manager (``Place`` reserves, records the ledger and commits; ``Release`` frees), and
:func:`remote_dist_attention` wires it with a transport (gRPC streams, or torch.distributed for the tensors)
into the one :class:`~infinite_llm.core.dist_attention.DistAttention` that the single-process engine uses
too. Sync gRPC: it runs on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import tenacity

from infinite_llm.client.errors import error_from_rpc
from infinite_llm.core.dist_attention import BlockId, BlockRef, DistAttention, HolderId
from infinite_llm.core.errors import CapacityExhausted, FailedPrecondition, InvalidRequest, Unavailable
from infinite_llm.core.prefix_cache import BlockHash
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.codec import dtype_name
from infinite_llm.rpc.errors import describe_rpc_error
from infinite_llm.rpc.kv_layout import kv_layout_text
from infinite_llm.rpc.options import serving_only

log = logging.getLogger(__name__)
CAPACITY_REFRESH_S = 1.0  # how stale the cluster's capacity view may be before it is read again (seconds)
# An unreachable manager (restarting, or etcd down) is retried with exponential backoff for this long
# (seconds) before the placement is given up for this step: the engine thread waits meanwhile.
# Only UNAVAILABLE is retried (Place is idempotent per first_block_index: a retry after a lost reply frees
# what the first placed and places again, GlobalManager.place).
PLACE_RETRY_S = 1.0
# Deadline of the engine thread's manager calls that a step can do without (a capacity read with a view to
# keep on a failure, and PublishPrefix, whose failure only leaves those rBlocks unshared; seconds):
# a frozen manager must not hold every running sequence's step for the call's full deadline.
OPTIONAL_CALL_S = 2.0
TRANSPORTS = ("grpc", "torch")


STARTUP_RETRY_S = 30.0  # how long a starting instance waits for an unreachable manager (seconds)


class ManagerPlacement:
    """rBlocks on the cluster's attention servers, placed by the global manager; learns their addresses.

    ``instance_id``: this compute instance, named in every placement so the ledger records whose sequence it
    is ('' = anonymous; the manager then counts no debt for it). :meth:`held_seq_ids` (heartbeats report it)
    lists every sequence from before its first ``Place`` until its ``Release`` was sent, so the manager
    reclaims any ledger entry of this instance that it does not list (a release lost in an outage).
    """

    def __init__(self, manager_address: str, block_size: int, timeout_s: float = 30.0, instance_id: str = "") -> None:
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.instance_id = instance_id
        self._manager = mgrpc.GlobalManagerStub(sync_channel(manager_address, extra_options=serving_only()))
        self._addresses: dict[HolderId, str] = {}
        self._lock = threading.Lock()
        self._capacity = (0, 0, 0.0)  # (total, free, read at monotonic time)
        self._cached_blocks = 0  # rBlocks in the cluster's prefix index, at the last capacity read
        self._to_publish: list[mpb.PrefixBlock] = []  # full rBlocks of this step, sent by flush_published
        self._held: set[str] = set()
        self._admitted: set[str] = set()  # sequences placed since their last release: a Place grows them
        self._claimed: set[str] = set()  # waiting sequences whose admission the manager refused (its claims)
        self._away_until = 0.0  # monotonic time until which the manager counts as away (no new retries)
        self._away_reason = ""  # what its last UNAVAILABLE said
        self._servers: dict[str, agrpc.AttentionServerStub] = {}

    def claimed_seq_ids(self) -> list[str]:
        """Waiting sequences whose admission the manager refused: each keeps a claim there, which heartbeats
        renew while it waits. Thread-safe."""
        with self._lock:
            return sorted(self._claimed)

    def drop_claim(self, seq_id: str) -> None:
        """``seq_id`` ended while waiting (finished, aborted, failed): stop listing its claim, which the next
        heartbeat then ends. Thread-safe; no-op without one."""
        with self._lock:
            self._claimed.discard(seq_id)

    def held_seq_ids(self) -> list[str]:
        """Sequences this instance holds, or is placing, rBlocks for. Thread-safe."""
        with self._lock:
            return sorted(self._held)

    def address_of(self, server: HolderId) -> str:
        """``host:port`` of an attention server this instance placed rBlocks on. Thread-safe."""
        with self._lock:
            address = self._addresses.get(server)
        if address is None:
            raise InvalidRequest(f"no address known for attention server {server!r}")
        return address

    def learn_address(self, server: HolderId, address: str) -> None:
        """Remember ``host:port`` of a server a migration moved rBlocks to. Thread-safe."""
        with self._lock:
            self._addresses[server] = address

    def check_cluster(self, layout: KVLayout | None = None) -> None:
        """Fail fast at startup: raises ``FailedPrecondition`` when a live attention server's block size
        differs from this instance's (the manager refuses such placements anyway), or, given the ``layout``
        this instance's model and dtype need, when a server keeps KV of another dtype, layer count, KV head
        count or head size (every step would be refused, and every request fail). A server that does not
        answer its ``GetStats`` is skipped (it may be stopping). A manager that is unreachable (starting, or
        its TLS handshake timed out on a loaded host) is retried with backoff for ``STARTUP_RETRY_S``
        seconds before ``Unavailable`` ends the start."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE
            ),
            wait=tenacity.wait_exponential(multiplier=0.2, max=2.0),
            stop=tenacity.stop_after_delay(STARTUP_RETRY_S),
            reraise=True,
        )
        try:
            state = retrying(self._manager.GetClusterState, mpb.ClusterStateRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        other = sorted({s.block_size for s in state.servers} - {self.block_size})
        if other:
            raise FailedPrecondition(
                f"this compute instance uses rBlocks of {self.block_size} tokens; the cluster's servers use {other}"
            )
        if layout is not None:
            for server in state.servers:
                self._check_layout(server.server_id, server.address, layout)

    def _check_layout(self, server_id: str, address: str, layout: KVLayout) -> None:
        """Raises ``FailedPrecondition`` when the server at ``address`` keeps KV unlike ``layout``."""
        channel = sync_channel(address)
        try:
            stub = agrpc.AttentionServerStub(channel)
            got = stub.GetStats(apb.GetStatsRequest(), timeout=min(self.timeout_s, OPTIONAL_CALL_S)).layout
        except grpc.RpcError as e:
            log.warning("attention server %s at %s did not say its KV layout: %s", server_id, address,
                        describe_rpc_error(e))  # fmt: skip
            return
        finally:
            channel.close()
        want = (dtype_name(layout.dtype), layout.num_layers, layout.num_kv_heads, layout.head_dim)
        have = (got.dtype, got.num_layers, got.num_kv_heads, got.head_dim)
        if have != want:
            raise FailedPrecondition(
                f"attention server {server_id} keeps KV as {kv_layout_text(*have)}; this compute instance's model "
                f"and --dtype need {kv_layout_text(*want)}: give every attention server and compute instance of a "
                "cluster the same model and dtype"
            )

    def _cluster(self) -> tuple[int, int]:
        """``(total, free)`` rBlocks of the cluster, read at most every ``CAPACITY_REFRESH_S``. While the manager
        is away (no manager leads: a failover, a restart) the last view stands, so requests are queued and
        wait for placement instead of refused; with no view yet, raises ``Unavailable``."""
        total, free, at = self._capacity
        now = time.monotonic()
        if now - at > CAPACITY_REFRESH_S:
            if total and now < self._away_until:
                return total, free
            try:
                timeout = min(self.timeout_s, OPTIONAL_CALL_S) if total else self.timeout_s  # a view to keep
                state = self._manager.GetClusterState(mpb.ClusterStateRequest(), timeout=timeout)
            except grpc.RpcError as e:
                if total and e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._pause(e)  # placement fails fast meanwhile, as after any UNAVAILABLE
                    self._capacity = (total, free, now)
                    return total, free
                raise error_from_rpc(e) from None
            total = sum(s.capacity_blocks for s in state.servers)
            free = sum(s.free_blocks for s in state.servers)
            self._capacity = (total, free, time.monotonic())
            self._cached_blocks = sum(s.cached_blocks for s in state.servers)
        return total, free

    @property
    def num_total_blocks(self) -> int:
        return self._cluster()[0]

    @property
    def num_free_blocks(self) -> int:
        return self._cluster()[1]

    def place(self, seq_id: str, n: int, first_index: int, near: HolderId | None = None) -> list[BlockRef] | None:
        """``n`` rBlocks for logical indices ``first_index ..``; ``None`` when the cluster is full now.
        ``near`` (the server of the sequence's last rBlock) goes to the manager, which places there first
        while it has room and is one of this instance's homes. The first Place of a sequence since its last
        release (beyond a matched prefix) admits it: the manager serves admissions first come, first served
        across compute instances, and returns ``None`` for this one while older ones wait for the rBlocks.

        Raises ``Unavailable`` when the manager stays unreachable through the retries, and at once for
        ``PLACE_RETRY_S`` after that (the other sequences of the step do not each wait the retries out).
        """
        admission = seq_id not in self._admitted
        request = mpb.PlaceRequest(
            seq_id=seq_id,
            num_blocks=n,
            first_block_index=first_index,
            block_size=self.block_size,
            instance_id=self.instance_id,
            near_server_id=near or "",
            admission=admission,
        )
        try:
            refs, _ = self._grants_of(seq_id, "Place", request)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # Nothing to place for this instance until rBlocks are freed: its own releases count at once,
                # the cluster's at the next read of the view. Without this, a waiting sequence that needs
                # more rBlocks than the view shows free asks the manager (MatchPrefix, Place) every step.
                self._capacity = (self._capacity[0], 0, time.monotonic())
                if admission:  # the manager keeps a claim for it while heartbeats list it
                    with self._lock:
                        self._claimed.add(seq_id)
                return None
            raise error_from_rpc(e) from None
        if len(refs) != n:
            raise CapacityExhausted(f"manager placed {len(refs)} rBlocks for {seq_id!r}, not {n}")
        self._admitted.add(seq_id)
        with self._lock:
            self._claimed.discard(seq_id)
        return refs

    # ---- prefix cache (issue 13): the cluster's index lives in the manager ---------------------------
    def match_prefix(self, seq_id: str, hashes: Sequence[BlockHash]) -> list[BlockRef]:
        """The longest prefix of ``hashes`` (32-byte block hashes of a new sequence's prompt) cached anywhere
        in the cluster, attached to ``seq_id`` at logical indices ``0..`` on the servers that hold it (the
        manager records them in the sequence's ledger entry); ``[]`` on a miss.

        Raises ``Unavailable`` when the manager stays unreachable (the scheduler retries the sequence next
        step; the manager frees what a lost attempt attached), other typed errors as ``place``.
        """
        request = mpb.MatchPrefixRequest(
            seq_id=seq_id, block_hashes=hashes, block_size=self.block_size, instance_id=self.instance_id
        )
        try:
            refs, had = self._grants_of(seq_id, "MatchPrefix", request)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        if not refs and not had:
            with self._lock:
                self._held.discard(seq_id)  # a miss leaves no ledger entry
        return refs

    def _grants_of(self, seq_id: str, method: str, request) -> tuple[list[BlockRef], bool]:  # noqa: ANN001
        """Call the manager's ``method`` (Place, MatchPrefix) that grants ``seq_id`` rBlocks; returns them (their
        servers' addresses learnt) and whether this instance held the sequence before.

        The sequence is listed as held before its ledger entry can exist (the reconciler then never takes
        it for an orphan), and unlisted again if the call fails and it was not held before. After an
        UNAVAILABLE the next calls fail at once for ``PLACE_RETRY_S``. Raises ``Unavailable`` (that case) or
        the call's ``grpc.RpcError``."""
        if time.monotonic() < self._away_until:
            raise Unavailable(f"placement is paused for {PLACE_RETRY_S:g} s after {self._away_reason}")
        with self._lock:
            had = seq_id in self._held
            self._held.add(seq_id)
        try:
            reply = self._call_manager(method, request)
        except grpc.RpcError as e:
            if not had:
                with self._lock:
                    self._held.discard(seq_id)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._pause(e)
            raise
        refs = []
        with self._lock:
            for g in reply.grants:
                self._addresses[HolderId(g.server_id)] = g.address
                refs.extend(BlockRef(HolderId(g.server_id), BlockId(int(b))) for b in g.block_ids)
        return refs, had

    def publish(self, seq_id: str, blocks: Sequence[tuple[int, BlockHash, BlockRef]]) -> int:
        """Queue full rBlocks of ``seq_id`` (``(logical index, hash, where)``) for the index; they go to the
        manager in one ``PublishPrefix`` per step (:meth:`flush_published`). Returns 0 (counted at flush)."""
        self._to_publish.extend(
            mpb.PrefixBlock(seq_id=seq_id, block_index=i, block_hash=h, server_id=ref.holder) for i, h, ref in blocks
        )
        return 0

    def flush_published(self) -> int:
        """Send the queued rBlocks (engine thread, after the step that completed them and before the next
        one is scheduled, so none was freed or re-placed meanwhile); returns how many the index took. A
        failure is logged and dropped: those blocks are just not shared."""
        blocks, self._to_publish = self._to_publish, []
        if not blocks or time.monotonic() < self._away_until:
            return 0
        try:
            request = mpb.PublishPrefixRequest(blocks=blocks)
            reply = self._manager.PublishPrefix(request, timeout=min(self.timeout_s, OPTIONAL_CALL_S))
        except grpc.RpcError as e:
            log.warning("publishing %d cached rBlocks failed: %s", len(blocks), e.details())
            return 0
        return reply.num_indexed

    def clear_prefix_cache(self) -> int:
        """A compute instance does not clear the cluster's cache (other instances read it): 0."""
        return 0

    @property
    def num_cached_blocks(self) -> int:
        """rBlocks in the cluster's prefix index (at most ``CAPACITY_REFRESH_S`` old)."""
        self._cluster()
        return self._cached_blocks

    def release(self, seq_id: str, holders: Sequence[HolderId]) -> int:
        """The manager frees the sequence's rBlocks on its servers and drops its ledger entry.

        If the manager stays unreachable (an outage), the holders free the rBlocks directly and the ledger
        entry is left to the manager's reconciliation (this instance no longer lists the sequence): a
        sequence that ends during an outage neither fails nor leaks. Like ``place``, it does not wait the
        retries out again for ``PLACE_RETRY_S`` after an UNAVAILABLE (the engine thread runs it between steps).
        """
        with self._lock:
            self._held.discard(seq_id)
        self._admitted.discard(seq_id)
        if time.monotonic() < self._away_until:
            return self._free_on_holders(seq_id, holders)
        try:
            reply = self._call_manager("Release", mpb.ReleaseRequest(seq_id=seq_id))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:  # already released
                return 0
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._pause(e)
                return self._free_on_holders(seq_id, holders)
            raise error_from_rpc(e) from None
        total, free, at = self._capacity
        self._capacity = (total, free + reply.num_freed, at)
        return reply.num_freed

    def _pause(self, e: grpc.RpcError) -> None:
        """No new manager call for ``PLACE_RETRY_S``, after the manager call that failed with ``e``."""
        self._away_until = time.monotonic() + PLACE_RETRY_S
        self._away_reason = f"a manager call failed with {describe_rpc_error(e)}"

    def _call_manager(self, method: str, request):  # noqa: ANN001, ANN202
        """One manager call, retried with exponential backoff (0.1 s doubling, up to ``PLACE_RETRY_S`` in
        all) while the manager is unreachable (UNAVAILABLE). Raises the last ``grpc.RpcError``."""
        unavailable = grpc.StatusCode.UNAVAILABLE
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, grpc.RpcError) and e.code() == unavailable),
            wait=tenacity.wait_exponential(multiplier=0.1, max=1.0),
            stop=tenacity.stop_after_delay(PLACE_RETRY_S),
            reraise=True,
        )
        return retrying(getattr(self._manager, method), request, timeout=self.timeout_s)

    def _free_on_holders(self, seq_id: str, holders: Sequence[HolderId]) -> int:
        """Free ``seq_id`` on each holder directly (best effort); returns the rBlocks freed."""
        freed = 0
        for holder in holders:
            try:
                stub = self._servers.get(holder)
                if stub is None:
                    stub = self._servers[holder] = agrpc.AttentionServerStub(sync_channel(self.address_of(holder)))
                request = apb.FreeSequenceRequest(seq_id=seq_id)
                freed += stub.FreeSequence(request, timeout=min(self.timeout_s, PLACE_RETRY_S)).num_freed
            except (grpc.RpcError, InvalidRequest, ValueError) as e:  # ValueError: no usable address known
                log.warning("could not free %s on %s directly: %s", seq_id[:64], holder, e)
        log.warning(
            "freed %d rBlocks of %s on its holders directly (%s); the manager reclaims its ledger entry later",
            freed,
            seq_id,
            self._away_reason,
        )
        return freed


def remote_dist_attention(
    manager_address: str,
    block_size: int,
    device: str = "cpu",
    timeout_s: float = 30.0,
    transport: str = "grpc",
    on_rpc: Callable[[str, float], None] | None = None,
    instance_id: str = "",
    prefix_cache_model_id: str | None = None,
) -> DistAttention:
    """DistAttention of a compute instance: placement by the manager, steps over ``transport``.

    ``transport`` ``"torch"`` sends the tensors over torch.distributed (gloo on CPU, NCCL between GPUs) and
    falls back to gRPC per server, logging the reason once, where a process group cannot form.
    ``on_rpc(server_id, seconds)`` is told how long each server took per layer (metrics). ``instance_id``
    names the instance in its placements (the ledger's owner of its sequences). ``prefix_cache_model_id``:
    the model's identity in the cluster's prefix-cache hashes (every instance serving the same weights must
    use the same one); ``None`` turns prefix caching off.
    """
    from infinite_llm.kernels import merge_partials
    from infinite_llm.services.compute.grpc_transport import GrpcTransport

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    placement = ManagerPlacement(manager_address, block_size, timeout_s, instance_id)
    if transport == "torch":
        from infinite_llm.services.compute.torch_transport import TorchTransport

        carrier = TorchTransport(placement.address_of, device, timeout_s, on_rpc)
    else:
        carrier = GrpcTransport(placement.address_of, timeout_s, on_rpc)
    return DistAttention(placement, carrier, block_size, device, merge_partials, prefix_cache_model_id)
