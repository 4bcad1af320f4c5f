"""Live migration on real attention servers: the compute-side executor moves a decoding sequence's rBlocks
between steps (Export, Import into the manager's reservations, free on the source, block-table flip), and
every step's merged attention still equals dense causal attention over all the K/V so far. A failed
migration leaves the source serving and nothing held on the destination."""

import pytest

from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.services.compute.migration import MigrationExecutor, Order
from tests.services.attention.helpers import TIMEOUT, Steps

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
        executor.between_steps()
        holders.append("".join(ref.holder for ref in steps.dist.block_table("s")))
        steps.step([SeqStep("s", pos, 1)])  # merged == dense over every K/V so far, or it raises
        computed["s"] = pos + 1
    executor.between_steps()
    results = executor.take_results()
    assert [(r.migration_id, r.num_blocks, r.num_moved, r.error) for r in results] == [(1, 3, 3, ""), (2, 2, 2, "")]
    assert [r.bytes_moved for r in results] == [3 * LAYOUT.bytes_per_block, 2 * LAYOUT.bytes_per_block]
    # One rBlock per step (before the step at position 10 + i): 0, 1, then 2 once 12 tokens have KV; the
    # second order waits for B's rBlocks 4 and 5 to fill (20 and 24 tokens).
    want = ["CAAABBCC", "CCAABBCC"] + ["CCCABBCC"] * 8 + ["CCCAABCC"] * 4 + ["CCCAAACC"] * 6
    assert holders == want
    assert [_stats(pairs[s]) for s in ("A", "B", "C")] == [(5, 3, 0), (8, 0, 0), (3, 5, 0)]
    assert executor.migrations_total == 2
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
    executor.between_steps()
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
    executor.between_steps()
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
    executor.between_steps()
    (result,) = executor.take_results()
    assert (result.num_moved, result.error) == (0, "the sequence is no longer running")


def test_migrating_a_shared_block_moves_only_the_readers_reference(make_pair):
    """Prefix caching: "r" reads "w"'s cached rBlocks 0, 1 on A. Migrating r's blocks to C gives r private
    copies with the same bytes; w keeps its blocks (never freed while read), still cached, and steps on with
    exact attention; once both end every rBlock is free again (the cached ones parked)."""
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
    placement.servers["r"] = ["A", "A", "C"]
    assert steps.dist.try_allocate("r", 1)  # r's private tail on C
    w_blocks = [ref.block_id for ref in steps.dist.block_table("w")[:2]]
    assert [ref.block_id for ref in steps.dist.block_table("r")[:2]] == w_blocks

    executor = MigrationExecutor(steps.dist, {"r": 9}.get, 16, timeout_s=TIMEOUT)
    rids = [pairs["C"].stub.ReserveBlocks(pb.ReserveBlocksRequest(seq_id="r", num_blocks=1), timeout=TIMEOUT)
            for _ in range(2)]  # fmt: skip
    executor.offer(Order(1, "r", "A", pairs["A"].address, "C", pairs["C"].address, [r.reservation_id for r in rids]))
    executor.between_steps()
    assert [(r.num_moved, r.error) for r in executor.take_results()] == [(2, "")]
    assert [ref.holder for ref in steps.dist.block_table("r")] == ["C", "C", "C"]
    assert [ref.block_id for ref in steps.dist.block_table("w")[:2]] == w_blocks  # the other reader's table
    assert [_stats(pairs[s]) for s in ("A", "C")] == [(5, 3, 0), (5, 3, 0)]  # w's 3 on A; r's 3 on C

    def payload(server: str, seq_id: str, ids: list[int]) -> list[bytes]:
        request = pb.ExportBlocksRequest(seq_id=seq_id, block_ids=ids)
        return [c.data for c in pairs[server].stub.ExportBlocks(request, timeout=TIMEOUT)][1:]

    r_blocks = [ref.block_id for ref in steps.dist.block_table("r")[:2]]
    assert payload("C", "r", r_blocks) == payload("A", "w", w_blocks)  # r's private copies: the same bytes
    steps.step([SeqStep("w", 10, 1)])  # w reads its cached blocks on: exact attention, or it raises
    steps.dist.free("w")
    steps.dist.free("r")
    assert [_stats(pairs[s]) for s in ("A", "C")] == [(8, 0, 0), (8, 0, 0)]
    assert pairs["A"].stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).num_cached == 2  # parked, free
