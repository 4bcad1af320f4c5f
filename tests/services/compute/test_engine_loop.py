"""The compute instance's engine thread over real attention servers (gRPC on loopback): a request that fails
alone (a bad id, a placement refused for its own sake, before or after it holds rBlocks) fails that request
only; the requests beside it finish with the in-process engine's greedy tokens and every rBlock is freed. A
server holding an rBlock of a sequence that its block table does not put there refuses the step, and the loop
recomputes instead of letting attention drift."""

import logging
import threading
import time

import pytest

from infinite_llm.core.dist_attention import DistAttention
from infinite_llm.core.errors import InvalidRequest, NotFound, Unavailable
from infinite_llm.core.rmanager import KVLayout
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine, RequestOutput
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.services.compute.engine_loop import EngineLoop
from infinite_llm.services.compute.grpc_transport import GrpcTransport
from tests.services.attention.helpers import TablePlacement

BLOCKS = 64  # per server
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class RefusingPlacement(TablePlacement):
    """Round-robin over the servers; refuses rBlocks as the manager refuses a placement about one sequence:
    ``refused-now-*`` at once, ``refused-late-*`` from logical block 2 on (it already holds two)."""

    def place(self, seq_id, n, first_index, near=None):  # noqa: ANN001, ANN201
        if seq_id.startswith("refused-now"):
            raise InvalidRequest(f"placement of {seq_id!r} refused", param="seq_id")
        if seq_id.startswith("refused-late") and first_index + n > 2:
            raise NotFound(f"no placement for sequence {seq_id!r}")
        self.servers.setdefault(seq_id, ["A", "B"] * 100)
        refs = super().place(seq_id, n, first_index, near)
        if seq_id.startswith("leftover") and first_index <= 1 < first_index + n and seq_id not in self.left:
            self.left.add(seq_id)  # A keeps an rBlock at index 1 from "an earlier placement"; the table says B
            self.pairs["A"].reserve_commit(seq_id, [1])
        return refs

    left: set[str] = set()


@pytest.fixture
def loop_over_servers(default_weights, make_pair):
    model_config, state_dict, tokenizer = default_weights
    layout = KVLayout(model_config.num_hidden_layers, 4, model_config.num_key_value_heads, model_config.head_dim)
    pairs = {s: make_pair(BLOCKS, layout, s, mirrored=False) for s in ("A", "B")}
    placement = RefusingPlacement(pairs)
    placement.num_total_blocks = 2 * BLOCKS
    kv = DistAttention(placement, GrpcTransport(lambda s: pairs[s].address, timeout_s=30), block_size=4)
    engine = LLMEngine.from_weights(model_config, state_dict, tokenizer, EngineConfig(block_size=4), kv=kv)
    loop = EngineLoop(engine)
    loop.start()
    yield loop, pairs
    loop.stop()


class Collected:
    """A sink that keeps the last output or the error of one request."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.final: RequestOutput | None = None
        self.error: Exception | None = None

    def __call__(self, out: RequestOutput | Exception) -> None:
        if isinstance(out, Exception):
            self.error = out
            self.done.set()
        elif out.finished:
            self.final = out
            self.done.set()


def test_a_request_that_fails_alone_leaves_the_others_correct(loop_over_servers, make_engine):
    loop, pairs = loop_over_servers
    local = make_engine(block_size=4, num_partitions=2, num_kv_blocks=2 * BLOCKS)
    ids = local.tokenizer.encode("the quick brown fox jumps over the lazy dog while a small cat watches " * 2)
    prompts = {f"good-{n}": ids[:n] for n in (3, 7, 13)}
    want = dict(zip(prompts, (o.token_ids for o in local.generate(list(prompts.values()), PARAMS)), strict=True))

    bad = {"a/b": ids[:5], "x" * 2_000_000: ids[:5], "refused-now-1": ids[:5], "refused-late-1": ids[:5]}
    sinks = {rid: Collected() for rid in (*prompts, *bad)}
    for rid, prompt in [*prompts.items(), *bad.items()]:  # all in flight together
        loop.submit(rid, prompt, PARAMS, sinks[rid])
    for sink in sinks.values():
        assert sink.done.wait(120)

    assert {rid: sinks[rid].final.token_ids for rid in prompts} == want
    assert all(sinks[rid].error is None and sinks[rid].final.finish_reason == "length" for rid in prompts)
    errors = {rid[:16]: (type(sinks[rid].error), sinks[rid].error.param) for rid in bad}
    assert errors == {
        "a/b": (InvalidRequest, "request_id"),
        "x" * 16: (InvalidRequest, "request_id"),
        "refused-now-1": (InvalidRequest, "seq_id"),
        "refused-late-1": (NotFound, None),
    }
    for pair in pairs.values():  # every rBlock back on the free list, the late-refused one's two included
        stats = pair.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert (stats.num_free, stats.num_reserved, stats.num_sequences) == (BLOCKS, 0, 0)
    assert not loop._sinks and loop.num_running == loop.num_waiting == 0

    again = Collected()  # the loop still serves
    loop.submit("good-again", prompts["good-7"], PARAMS, again)
    assert again.done.wait(120) and again.final.token_ids == want["good-7"]


def test_aborts_cut_a_running_step_at_most_once_per_cut_interval(make_engine):
    """An abort of a running request cuts the step (``_interrupt`` True before the next layer), but not
    again within ``cut_interval_s``: a client aborting request after request cannot keep cutting everyone
    else's steps. (The loop thread is not started: the test drives the engine thread's side by hand.)"""
    engine = make_engine(num_kv_blocks=64)
    rid = engine.add_request("Hello there", PARAMS, request_id="victim-or-attacker")
    engine.step()  # prefill: the request is running now
    assert [s.seq_id for s in engine.scheduler.running] == [rid]
    rate_limited, unlimited = EngineLoop(engine, cut_interval_s=3600), EngineLoop(engine, cut_interval_s=0)
    for loop in (rate_limited, unlimited):
        assert loop._interrupt() is False  # nothing aborted
        loop._aborting.add("not-running")
        assert loop._interrupt() is False  # an abort of a request the step does not run cuts nothing
        loop._aborting.add(rid)
    assert [rate_limited._interrupt() for _ in range(3)] == [True, False, False]
    assert [unlimited._interrupt() for _ in range(3)] == [True, True, True]
    engine.abort(rid)


def test_a_server_holding_an_rblock_the_block_table_does_not_put_there_refuses_the_step_and_the_loop_recomputes(
    loop_over_servers, make_engine
):
    """The collision a manager restart once caused: a sequence placed again while a server still held a
    leftover rBlock of it at an index the new block table puts elsewhere. That server would attend over the
    leftover too, silently (the CI run where greedy output drifted). It refuses the step (FAILED_PRECONDITION,
    ``num_blocks_here``), the loop recomputes every running sequence (the release frees the leftover with the
    rest), and every output equals the in-process engine's."""
    loop, pairs = loop_over_servers
    local = make_engine(block_size=4, num_partitions=2, num_kv_blocks=2 * BLOCKS)
    ids = local.tokenizer.encode("the quick brown fox jumps over the lazy dog while a small cat watches " * 2)
    prompts = {"leftover-1": ids[:6], "good-1": ids[:9]}
    want = dict(zip(prompts, (o.token_ids for o in local.generate(list(prompts.values()), PARAMS)), strict=True))
    sinks = {rid: Collected() for rid in prompts}
    for rid, prompt in prompts.items():
        loop.submit(rid, prompt, PARAMS, sinks[rid])
    for sink in sinks.values():
        assert sink.done.wait(120)
    assert {rid: (s.error, s.final.token_ids) for rid, s in sinks.items()} == {rid: (None, want[rid]) for rid in want}
    assert loop._failures == 0 and loop.engine.num_preemptions >= 2  # recomputed both, then stepped on
    for pair in pairs.values():  # the leftover freed with the rest
        stats = pair.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert (stats.num_free, stats.num_reserved, stats.num_sequences) == (BLOCKS, 0, 0)


def test_a_migration_order_whose_sequence_ended_settles_while_the_loop_idles(loop_over_servers):
    """An order reaches an idle instance (its sequence finished meanwhile): offering it wakes the engine
    thread, which ends it at once ("no longer running", nothing moved) instead of at the next request's first
    step; the manager then cancels its reservations and the destination is back to baseline."""
    import time

    from infinite_llm.services.compute.migration import Order
    from infinite_llm.services.compute.server import ComputeConfig, migration_executor

    loop, pairs = loop_over_servers
    config = ComputeConfig(manager_address="127.0.0.1:1", block_size=4)
    executor = migration_executor(loop, loop.engine.kv, config)
    done = Collected()
    loop.submit("ended-1", list(range(10, 19)), PARAMS, done)
    assert done.done.wait(120) and done.error is None
    request = pb.ReserveBlocksRequest(seq_id="ended-1", num_blocks=1)
    rids = [pairs["B"].stub.ReserveBlocks(request, timeout=10).reservation_id for _ in range(2)]
    executor.offer(Order(1, "ended-1", "A", pairs["A"].address, "B", pairs["B"].address, rids))
    deadline, results = time.monotonic() + 10, []
    while not results and time.monotonic() < deadline:
        time.sleep(0.02)
        results = executor.take_results()
    assert [(r.migration_id, r.num_moved, r.error) for r in results] == [(1, 0, "the sequence is no longer running")]
    for rid in rids:  # what the manager does on settling
        pairs["B"].stub.CancelReservation(pb.CancelReservationRequest(reservation_id=rid), timeout=10)
    stats = pairs["B"].stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert (stats.num_free, stats.num_reserved, stats.num_sequences) == (BLOCKS, 0, 0)


def test_a_stalled_loop_backs_off_logs_rarely_and_resumes_with_the_same_tokens(make_engine, caplog):
    """A running sequence that gets no rBlocks (placement paused: the manager unreachable) stalls every step
    it is scheduled: the loop waits between such steps (doubling from 5 to 100 ms, ended by any command)
    instead of spinning a core, and logs the stall at most once per ``STALL_LOG_INTERVAL_S``. Found on a
    real mesh: 19,800 warnings and 20,174 engine steps in 6 s of a manager outage, for 3 requests. Once
    placement is back, the sequence goes on with the greedy tokens of an engine that never stalled."""
    reference = make_engine(num_kv_blocks=64)
    ids = reference.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = reference.generate([ids], params)[0].token_ids

    engine = make_engine(num_kv_blocks=64)
    placement, place = engine.kv.placement, engine.kv.placement.place
    paused = threading.Event()
    paused.set()

    def paused_growth(seq_id, n, first_index, near=None):  # noqa: ANN001, ANN202
        if paused.is_set() and first_index > 0:  # admitted, then stalls at its first new rBlock
            raise Unavailable("placement is paused (test)")
        return place(seq_id, n, first_index, near)

    placement.place = paused_growth
    schedules = 0
    schedule = engine.scheduler.schedule

    def counted():  # noqa: ANN202
        nonlocal schedules
        schedules += 1
        return schedule()

    engine.scheduler.schedule = counted
    loop = EngineLoop(engine)
    loop.start()
    try:
        done = Collected()
        with caplog.at_level(logging.WARNING, logger="infinite_llm.core.scheduler"):
            loop.submit("stalls", ids, params, done)
            deadline = time.monotonic() + 30
            while not loop.stalled and time.monotonic() < deadline:
                time.sleep(0.01)
            assert loop.stalled, "the sequence never stalled"
            start = schedules
            time.sleep(1.0)
            stalled_steps = schedules - start
            paused.clear()
            assert done.done.wait(60) and done.error is None
        warnings = [r for r in caplog.records if "no rBlocks for 'stalls'" in r.getMessage()]
    finally:
        loop.stop()
    # 1 s of waits doubling from 5 ms to 100 ms is about 13 steps; a spinning loop runs thousands
    assert 5 <= stalled_steps <= 20, stalled_steps
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert done.final.token_ids == want
