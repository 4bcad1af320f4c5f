"""Live migration on real attention servers: the compute-side executor moves a decoding sequence's rBlocks
(Export and a staged Import into the manager's reservations during a step; between steps commit on the
destination, free on the source, block-table flip), and every step's merged attention still equals dense
causal attention over all the K/V so far. A failed migration leaves the source serving and nothing held on
the destination."""

import threading
import time

import grpc
import pytest

from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.services.compute.migration import MigrationExecutor, Order
from tests.services.attention.helpers import TIMEOUT, Pair, Steps

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
NUM_HEADS = 4


def _stats(pair) -> tuple[int, int, int]:
    s = pair.stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    return s.num_free, s.num_used, s.num_reserved


def _reserve(pair, seq_id: str, n: int) -> list[int]:
    """What the manager does before ordering a move: one reservation of one rBlock per moved rBlock."""
    request = pb.ReserveBlocksRequest(seq_id=seq_id, num_blocks=1)
    return [pair.stub.ReserveBlocks(request, timeout=TIMEOUT).reservation_id for _ in range(n)]


@pytest.fixture
def cluster(make_pair):
    pairs = {s: make_pair(8, LAYOUT, s, mirrored=False) for s in ("A", "B", "C")}
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    steps.place("s", ["A", "A", "A", "A", "B", "B", "C", "C"])  # 32 tokens of room
    return pairs, steps


def _executor(steps: Steps, computed: dict[str, int], tokens_per_step: int) -> MigrationExecutor:
    return MigrationExecutor(steps.dist, computed.get, tokens_per_step, timeout_s=TIMEOUT)


def _between_steps(executor: MigrationExecutor) -> None:
    """The copy the previous call started is done, as it normally is by the end of a step, then the call."""
    executor.flush()
    executor.between_steps()


def _order(mid: int, pairs, src: str, dst: str, rids: list[int]) -> Order:
    return Order(mid, "s", src, pairs[src].address, dst, pairs[dst].address, rids)


def test_sequence_migrates_across_three_servers_mid_decode_with_exact_attention(cluster):
    pairs, steps = cluster
    computed = {"s": 0}
    executor = _executor(steps, computed, tokens_per_step=4)  # one rBlock per step
    steps.step([SeqStep("s", 0, 10)])  # prefill: rBlocks 0, 1 full, 2 half
    computed["s"] = 10
    executor.offer(_order(1, pairs, "A", "C", _reserve(pairs["C"], "s", 3)))  # rBlocks 0, 1, 2 of A
    executor.offer(_order(2, pairs, "B", "A", _reserve(pairs["A"], "s", 2)))  # rBlocks 4, 5: not full yet
    holders = []
    for pos in range(10, 30):
        _between_steps(executor)
        holders.append("".join(ref.holder for ref in steps.dist.block_table("s")))
        steps.step([SeqStep("s", pos, 1)])  # merged == dense over every K/V so far, or it raises
        computed["s"] = pos + 1
    _between_steps(executor)
    results = executor.take_results()
    assert [(r.migration_id, r.num_blocks, r.num_moved, r.error) for r in results] == [(1, 3, 3, ""), (2, 2, 2, "")]
    assert [r.bytes_moved for r in results] == [3 * LAYOUT.bytes_per_block, 2 * LAYOUT.bytes_per_block]
    # One rBlock per step, copied during the step after the call that picks it and switched by the next call
    # (before the step at position 10 + i): 0, 1, then 2 (picked once 12 tokens have KV); the second order
    # waits for B's rBlocks 4 and 5 to fill (picked at 20 and 24 tokens).
    want = ["AAAABBCC", "CAAABBCC", "CCAABBCC"] + ["CCCABBCC"] * 8 + ["CCCAABCC"] * 4 + ["CCCAAACC"] * 5
    assert holders == want
    assert [_stats(pairs[s]) for s in ("A", "B", "C")] == [(5, 3, 0), (8, 0, 0), (3, 5, 0)]
    assert executor.migrations_total == 2
    steps.dist.free("s")
    assert [_stats(pairs[s]) for s in ("A", "B", "C")] == [(8, 0, 0)] * 3


def test_an_order_off_a_draining_server_copies_at_the_drain_budget(cluster):
    """A server that is stopping must empty before its deadline: an order marked ``drain`` copies up to the
    drain budget per step (here 3 rBlocks), a rebalancing order its own (1), and attention stays exact."""
    pairs, steps = cluster
    computed = {"s": 0}
    executor = MigrationExecutor(steps.dist, computed.get, 4, timeout_s=TIMEOUT, drain_tokens_per_step=12)
    steps.step([SeqStep("s", 0, 25)])  # rBlocks 0-3 (A) and 4-5 (B) full
    computed["s"] = 25
    drain = _order(1, pairs, "A", "C", _reserve(pairs["C"], "s", 4))
    drain.drain = True
    executor.offer(drain)
    executor.offer(_order(2, pairs, "B", "C", _reserve(pairs["C"], "s", 2)))
    holders = []
    for pos in range(25, 31):
        _between_steps(executor)
        holders.append("".join(ref.holder for ref in steps.dist.block_table("s")))
        steps.step([SeqStep("s", pos, 1)])
        computed["s"] = pos + 1
    # Each call switches the copy made during the last step and starts the next: 3 rBlocks, then the drain's
    # last one; the next call starts the rebalancing order, which copies one rBlock per step.
    assert holders == ["AAAABBCC", "CCCABBCC", "CCCCBBCC", "CCCCBBCC", "CCCCCBCC", "CCCCCCCC"]
    results = executor.take_results()
    assert [(r.migration_id, r.num_moved, r.error) for r in results] == [(1, 4, ""), (2, 2, "")]
    steps.dist.free("s")
    assert [_stats(pairs[s]) for s in ("A", "B", "C")] == [(8, 0, 0)] * 3


def test_failed_import_leaves_the_source_serving_and_nothing_on_the_destination(cluster):
    pairs, steps = cluster
    computed = {"s": 10}
    executor = _executor(steps, computed, tokens_per_step=16)
    steps.step([SeqStep("s", 0, 10)])
    before = [_stats(pairs[s]) for s in ("A", "B", "C")]
    table = steps.dist.block_table("s")
    # The manager's reservations on C are gone (expired, or the destination restarted): the import is refused.
    executor.offer(_order(7, pairs, "A", "C", [987654, 987655]))
    _between_steps(executor)  # starts the copy: the staged import is refused
    assert executor.take_results() == []
    _between_steps(executor)  # sees the failure, switches nothing
    (result,) = executor.take_results()
    assert (result.num_moved, result.bytes_moved) == (0, 0) and result.error.startswith("NOT_FOUND")
    assert steps.dist.block_table("s") == table
    assert [_stats(pairs[s]) for s in ("A", "B", "C")] == before
    steps.step([SeqStep("s", 10, 1)])  # still exact on the source
    assert not executor.busy


def test_destination_killed_mid_migration_keeps_the_rest_on_the_source(make_server, make_pair, loop):
    pairs = {s: make_pair(8, LAYOUT, s, mirrored=False) for s in ("A", "B")}
    server_c, stub_c = make_server(8, LAYOUT, "C")
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    steps.place("s", ["A", "A", "A", "B"])
    computed = {"s": 12}
    executor = MigrationExecutor(steps.dist, computed.get, 4, timeout_s=TIMEOUT)
    steps.step([SeqStep("s", 0, 12)])
    rids = [stub_c.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="s", num_blocks=1), timeout=TIMEOUT).reservation_id
            for _ in range(3)]  # fmt: skip
    a_before = _stats(pairs["A"])
    loop.run(server_c.stop(0))  # the destination dies before the first rBlock lands
    executor.offer(Order(3, "s", "A", pairs["A"].address, "C", server_c.address, rids))
    _between_steps(executor)  # starts the copy
    _between_steps(executor)  # sees it failed
    (result,) = executor.take_results()
    assert result.num_moved == 0 and result.error.startswith("UNAVAILABLE")
    assert "".join(r.holder for r in steps.dist.block_table("s")) == "AAAB"
    assert _stats(pairs["A"]) == a_before
    steps.step([SeqStep("s", 12, 1)])  # exact: A still serves all three
    steps.dist.free("s")
    assert _stats(pairs["A"]) == (8, 0, 0)


def test_an_order_for_a_finished_sequence_ends_without_moving(cluster):
    pairs, steps = cluster
    executor = _executor(steps, {}, tokens_per_step=16)
    executor.offer(_order(9, pairs, "A", "C", _reserve(pairs["C"], "s", 1)))
    _between_steps(executor)
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (0, "the sequence is no longer running")


def test_a_shared_block_moves_with_all_its_readers(make_pair):
    """Prefix caching: "r" reads "w"'s cached rBlocks 0, 1 on A. Migrating r's blocks to C gives C a copy
    cached under the same hashes (the export carries them); then what the manager does on settling, C's copy
    attached to "w" and a re-attach order for w, flips w's entries to C too. A keeps only w's private tail,
    its old shared copies parked (free); both sequences step on with exact attention over the moved KV; once
    both end every rBlock is free again."""
    from infinite_llm.core.dist_attention import BlockId, BlockRef, HolderId
    from infinite_llm.core.prefix_cache import block_hashes

    pairs = {s: make_pair(8, LAYOUT, s, mirrored=False) for s in ("A", "C")}
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    tokens = list(range(100, 110))
    hashes = block_hashes(tokens, LAYOUT.block_size, "m")  # blocks 0, 1

    class Sharing(type(steps.placement)):
        def match_prefix(self, seq_id, wanted):  # noqa: ANN001, ANN202
            request = pb.AttachBlocksRequest(seq_id=seq_id, first_block_index=0, block_hashes=wanted)
            reply = pairs["A"].stub.AttachBlocks(request, timeout=TIMEOUT)
            return [BlockRef(HolderId("A"), BlockId(b)) for b in reply.block_ids]

    placement = Sharing(pairs)
    steps.placement = placement
    steps.dist = type(steps.dist)(placement, steps.transport, LAYOUT.block_size, prefix_cache_model_id="m")
    steps.place("w", ["A", "A", "A"])
    steps.step([SeqStep("w", 0, 10)])
    cached = pairs["A"].stub.CacheBlocks(
        pb.CacheBlocksRequest(seq_id="w", block_indices=[0, 1], block_hashes=hashes), timeout=TIMEOUT
    )
    assert list(cached.cached_hashes) == hashes
    assert steps.dist.match_prefix("r", tokens) == 8  # both full blocks, shared
    for layer in range(LAYOUT.num_layers):  # r's dense reference starts from w's prefix K/V
        steps.kv[("r", layer)] = tuple(x[:8] for x in steps.kv[("w", layer)])
    placement.servers["r"] = ["A", "A", "C"]
    assert steps.dist.try_allocate("r", 1)  # r's private tail on C
    w_blocks = [ref.block_id for ref in steps.dist.block_table("w")[:2]]
    assert [ref.block_id for ref in steps.dist.block_table("r")[:2]] == w_blocks
    computed = {"r": 8, "w": 11}

    executor = MigrationExecutor(steps.dist, computed.get, 16, timeout_s=TIMEOUT)
    rids = [pairs["C"].stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="r", num_blocks=1), timeout=TIMEOUT)
            for _ in range(2)]  # fmt: skip
    executor.offer(Order(1, "r", "A", pairs["A"].address, "C", pairs["C"].address, [r.reservation_id for r in rids]))
    _between_steps(executor)  # copies both during the (here absent) step: staged on C, reserved, uncached
    assert pairs["C"].stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_cached == 0
    _between_steps(executor)  # commits them (cached now), frees them on A, flips r's table
    (moved,) = executor.take_results()
    assert (moved.num_moved, moved.error, list(moved.cached_hashes), moved.block_indices) == (2, "", hashes, ())
    assert [ref.holder for ref in steps.dist.block_table("r")] == ["C", "C", "C"]
    assert [ref.block_id for ref in steps.dist.block_table("w")[:2]] == w_blocks  # w's own order comes next
    assert pairs["C"].stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_cached == 2

    def payload(server: str, seq_id: str, ids: list[int]) -> list[bytes]:
        request = pb.ExportBlocksRequest(seq_id=seq_id, block_ids=ids)
        return [c.data for c in pairs[server].stub.ExportBlocks(request, timeout=TIMEOUT)][1:]

    r_blocks = [ref.block_id for ref in steps.dist.block_table("r")[:2]]
    assert payload("C", "r", r_blocks) == payload("A", "w", w_blocks)  # the same bytes

    # The manager's part on settling: who else reads A's copies, and a reservation of references to C's.
    readers = pairs["A"].stub.BlockReaders(pb.BlockReadersRequest(block_hashes=hashes), timeout=TIMEOUT).readers
    assert [(r.block_hash, r.seq_id, r.block_index) for r in readers] == [(hashes[0], "w", 0), (hashes[1], "w", 1)]
    attach = pb.AttachBlocksRequest(seq_id="w", block_hashes=hashes, reserve=True)
    held = pairs["C"].stub.AttachBlocks(attach, timeout=TIMEOUT)
    assert list(held.block_ids) == r_blocks
    steps.step([SeqStep("w", 10, 1)])  # until w's instance flips, C's table for w is unchanged: w steps on
    executor.offer(Order(2, "w", "A", pairs["A"].address, "C", pairs["C"].address, [held.reservation_id], [0, 1]))
    _between_steps(executor)
    (reattached,) = executor.take_results()
    assert (reattached.num_moved, reattached.error, reattached.block_indices) == (2, "", (0, 1))
    assert [ref.holder for ref in steps.dist.block_table("w")] == ["C", "C", "A"]
    assert [ref.block_id for ref in steps.dist.block_table("w")[:2]] == r_blocks
    # A: w's private tail only (its old shared copies parked: free, still cached); C: r's 3, two of them read by w.
    assert [_stats(pairs[s]) for s in ("A", "C")] == [(7, 1, 0), (5, 3, 0)]
    assert pairs["A"].stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_cached == 2

    steps.step([SeqStep("w", 11, 1), SeqStep("r", 8, 2)])  # exact attention for both, or it raises
    steps.step([SeqStep("r", 10, 1)])
    steps.dist.free("w")
    assert _stats(pairs["C"]) == (5, 3, 0)  # r still reads them
    steps.dist.free("r")
    assert [_stats(pairs[s]) for s in ("A", "C")] == [(8, 0, 0), (8, 0, 0)]


def test_a_reattach_order_does_nothing_if_an_entry_is_no_longer_on_the_source(make_pair):
    """The reader's entry 0 moved elsewhere meanwhile: the order commits, frees and flips nothing (all or
    nothing), and says why; the manager then cancels its reservation."""
    pairs = {s: make_pair(8, LAYOUT, s, mirrored=False) for s in ("A", "C")}
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    steps.place("w", ["C", "A", "A"])
    steps.step([SeqStep("w", 0, 10)])
    table = steps.dist.block_table("w")
    rid = _reserve(pairs["C"], "w", 1)[0]
    executor = MigrationExecutor(steps.dist, {"w": 10}.get, 16, timeout_s=TIMEOUT)
    executor.offer(Order(5, "w", "A", pairs["A"].address, "C", pairs["C"].address, [rid], [0, 1]))
    _between_steps(executor)
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (0, "rBlock 0 of the sequence is no longer on A")
    assert steps.dist.block_table("w") == table
    assert [_stats(pairs[s]) for s in ("A", "C")] == [(6, 2, 0), (6, 1, 1)]  # the reservation still open
    steps.step([SeqStep("w", 10, 1)])


def test_the_executor_reports_its_pace_moving_time_against_the_steps_between(cluster):
    """``on_paced`` gets, per call that works on an order (starts, waits for or switches a copy), the seconds it
    spent and the seconds since the previous such call (the step in between, during which the copy ran; 0 for
    the call that starts the order); a call with no order reports nothing."""
    pairs, steps = cluster
    computed = {"s": 0}
    paced: list[tuple[float, float]] = []
    executor = MigrationExecutor(
        steps.dist, computed.get, 4, timeout_s=TIMEOUT, on_paced=lambda m, s: paced.append((m, s))
    )
    steps.step([SeqStep("s", 0, 10)])
    computed["s"] = 10
    _between_steps(executor)  # no order yet: nothing reported
    assert paced == []
    executor.offer(_order(1, pairs, "A", "C", _reserve(pairs["C"], "s", 2)))  # rBlocks 0 and 1, one per call
    _between_steps(executor)  # starts copying rBlock 0
    time.sleep(0.2)  # stands for a step
    _between_steps(executor)  # switches rBlock 0, starts copying rBlock 1
    time.sleep(0.3)
    _between_steps(executor)  # switches the second and ends the order
    _between_steps(executor)  # no order: nothing
    assert len(paced) == 3 and all(moving > 0 for moving, _ in paced)
    assert [stepping for _, stepping in paced][0] == 0.0
    assert 0.2 <= paced[1][1] < 0.2 + 1.0 and 0.3 <= paced[2][1] < 0.3 + 1.0
    assert [r.num_moved for r in executor.take_results()] == [2]


def test_a_copy_slower_than_the_step_is_switched_at_a_later_call(cluster):
    """The engine thread does not wait for a copy still running: the source serves the step on (exact), and
    the call after the copy finished switches it."""
    pairs, steps = cluster
    executor = _executor(steps, {"s": 10}, tokens_per_step=4)
    steps.step([SeqStep("s", 0, 10)])
    gate = threading.Event()
    executor._copier.submit(gate.wait, TIMEOUT)  # the worker is busy: the copy below queues behind this
    executor.offer(_order(7, pairs, "A", "C", _reserve(pairs["C"], "s", 1)))
    executor.between_steps()  # starts the copy (queued)
    executor.between_steps()  # not done: nothing switched, no wait
    assert executor.take_results() == [] and steps.dist.block_table("s")[0].holder == "A"
    steps.step([SeqStep("s", 10, 1)])  # the source serves: exact
    gate.set()
    _between_steps(executor)
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (1, "")
    assert steps.dist.block_table("s")[0].holder == "C"
    steps.step([SeqStep("s", 11, 1)])


def test_a_sequence_that_ends_while_its_rblocks_are_copied_switches_nothing(cluster):
    """The copy finishes (staged on C, still reserved) but the sequence stopped running meanwhile: nothing
    is committed or freed, the order ends once the copy is done, and the manager's cancel of its
    reservations leaves C as it was."""
    pairs, steps = cluster
    computed = {"s": 10}
    executor = _executor(steps, computed, tokens_per_step=8)  # two rBlocks per step
    steps.step([SeqStep("s", 0, 10)])
    rids = _reserve(pairs["C"], "s", 2)
    before_a, table = _stats(pairs["A"]), steps.dist.block_table("s")
    executor.offer(_order(4, pairs, "A", "C", rids))
    _between_steps(executor)
    del computed["s"]
    _between_steps(executor)
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (0, "the sequence is no longer running")
    assert steps.dist.block_table("s") == table and _stats(pairs["A"]) == before_a
    assert _stats(pairs["C"]) == (4, 2, 2)  # s's own rBlocks 6 and 7, and the two staged, never committed
    for rid in rids:  # what the manager does on settling
        pairs["C"].stub.CancelReservation(pb.CancelReservationRequest(reservation_id=rid), timeout=TIMEOUT)
    assert _stats(pairs["C"]) == (6, 2, 0)


def test_an_entry_that_changed_while_copied_is_not_switched(cluster):
    """Between the copy's start and the switch the sequence's entry 1 was replaced (here by hand, as a
    re-placement would): entry 0 is switched, entry 1 is not, and the order stops there."""
    from infinite_llm.core.dist_attention import BlockId, BlockRef, HolderId

    pairs, steps = cluster
    executor = _executor(steps, {"s": 10}, tokens_per_step=8)
    steps.step([SeqStep("s", 0, 10)])
    executor.offer(_order(5, pairs, "A", "C", _reserve(pairs["C"], "s", 2)))
    _between_steps(executor)
    table = steps.dist.block_table("s")
    changed = BlockRef(HolderId("A"), BlockId(7))
    steps.dist.replace_table("s", [*table[:1], changed, *table[2:]])
    _between_steps(executor)
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (1, "rBlock 1 of the sequence changed while it was copied")
    assert [r.holder for r in steps.dist.block_table("s")[:2]] == ["C", "A"]
    assert steps.dist.block_table("s")[1] == changed
    assert _stats(pairs["C"]) == (4, 3, 1)  # entry 0 joined rBlocks 6, 7; entry 1's copy stays reserved


def test_a_second_commit_refused_keeps_the_first_moved_and_the_rest_on_the_source(cluster):
    """Two rBlocks staged; the second's reservation is gone by the switch (cancelled, expired): the first is
    committed, freed on A and flipped, the second stays on A, and the result says 1 moved (the manager then
    cancels the reservations after the first). Attention stays exact."""
    pairs, steps = cluster
    executor = _executor(steps, {"s": 10}, tokens_per_step=8)
    steps.step([SeqStep("s", 0, 10)])
    rids = _reserve(pairs["C"], "s", 2)
    executor.offer(_order(6, pairs, "A", "C", rids))
    _between_steps(executor)
    executor.flush()  # the copy landed
    pairs["C"].stub.CancelReservation(pb.CancelReservationRequest(reservation_id=rids[1]), timeout=TIMEOUT)
    _between_steps(executor)
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (1, f"NOT_FOUND: no reservation {rids[1]}")
    assert [ref.holder for ref in steps.dist.block_table("s")[:2]] == ["C", "A"]
    assert [_stats(pairs[s]) for s in ("A", "C")] == [(5, 3, 0), (5, 3, 0)]
    steps.step([SeqStep("s", 10, 1)])  # exact, or it raises


def test_a_source_gone_before_the_switch_leaves_nothing_on_the_destination(make_server, make_pair, loop):
    """The copy landed (staged on C) but A died before the switch: C commits, A's free fails, so C frees its
    copies again; nothing moved, and once the manager cancels the reservations C is as before."""
    server_a, stub_a = make_server(8, LAYOUT, "A")
    pairs = {"A": Pair(stub_a, 8, LAYOUT, mirrored=False, address=server_a.address)}
    pairs["C"] = make_pair(8, LAYOUT, "C", mirrored=False)
    steps = Steps(pairs, LAYOUT, NUM_HEADS)
    steps.place("s", ["A", "A", "A", "C"])
    steps.step([SeqStep("s", 0, 12)])
    before_c = _stats(pairs["C"])
    rids = _reserve(pairs["C"], "s", 2)
    executor = _executor(steps, {"s": 12}, tokens_per_step=8)
    executor.offer(_order(8, pairs, "A", "C", rids))
    _between_steps(executor)
    executor.flush()  # the copy landed
    loop.run(server_a.stop(0))
    _between_steps(executor)
    (result,) = executor.take_results()
    assert result.num_moved == 0 and result.error.startswith("UNAVAILABLE")
    assert [ref.holder for ref in steps.dist.block_table("s")] == ["A", "A", "A", "C"]
    for rid in rids:  # the manager's cancels: both were committed and freed again, so both are unknown now
        with pytest.raises(grpc.RpcError):
            pairs["C"].stub.CancelReservation(pb.CancelReservationRequest(reservation_id=rid), timeout=TIMEOUT)
    assert _stats(pairs["C"]) == before_c
