"""Scheduler policy as an executable spec: chunked prefill, token budget, admission, preemption, finish."""

import pytest

from infinite_llm.core.dist_attention import DistAttention
from infinite_llm.core.errors import CapacityExhausted, InvalidRequest
from infinite_llm.core.local_transport import LocalPlacement, LocalTransport, partition_id
from infinite_llm.core.rmanager import KVLayout, RManager
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.core.scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus

LAYOUT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4)


def _sched(num_blocks, max_seqs=8, budget=8):
    holders = {partition_id(0): RManager(num_blocks, LAYOUT)}
    kv = DistAttention(LocalPlacement(holders), LocalTransport(holders), LAYOUT.block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), kv


def _seq(sid, n_prompt, max_tokens=4):
    return Sequence(sid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def _run(sched, out, token=7):
    """Pretend the model ran: mark computed and append a token to sequences that sample."""
    sched.mark_computed(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.output_token_ids.append(token)


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    sched, kv = _sched(num_blocks=16, budget=8)
    a = _seq("a", 19)
    sched.add(a)
    spans = []
    for _ in range(3):
        out = sched.schedule()
        spans.append([(s.seq.seq_id, s.num_computed_tokens, s.num_new, s.samples) for s in out.scheduled])
        _run(sched, out)
    assert spans == [[("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 3, True)]]
    assert [b.block_id for b in kv.block_table("a")] == [0, 1, 2, 3, 4]


def test_decodes_run_first_then_waiting_prefills_fill_the_budget():
    sched, _ = _sched(num_blocks=16, budget=6)
    a, b, c = _seq("a", 2), _seq("b", 5), _seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [("a", 2), ("b", 4)]
    _run(sched, out)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_computed_tokens, s.num_new) for s in out.scheduled] == [
        ("a", 2, 1),
        ("b", 4, 1),
        ("c", 0, 3),
    ]


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = _sched(num_blocks=16, max_seqs=2, budget=64)
    for sid in "abc":
        sched.add(_seq(sid, 2))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["a", "b"]
    assert [s.seq_id for s in sched.waiting] == ["c"]


def test_latest_admitted_sequence_is_preempted_when_blocks_run_out():
    sched, kv = _sched(num_blocks=3, budget=64)
    a, b = _seq("a", 4, max_tokens=8), _seq("b", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a: block 0, b: block 1
    _run(sched, out)
    out = sched.schedule()  # a needs a 2nd block (2); b needs one too: none left -> b preempted
    assert [s.seq.seq_id for s in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b]


def test_finish_frees_blocks_and_removes_the_sequence():
    sched, kv = _sched(num_blocks=4)
    a = _seq("a", 6)
    sched.add(a)
    _run(sched, sched.schedule())
    assert kv.num_free_blocks == 2
    sched.finish(a, "abort")
    assert kv.num_free_blocks == 4 and not sched.has_unfinished()
    assert (a.status, a.finish_reason) == (SequenceStatus.FINISHED, "abort")


def test_request_larger_than_all_kv_memory_is_refused_up_front():
    sched, _ = _sched(num_blocks=4)
    with pytest.raises(CapacityExhausted, match="needs 5 rBlocks"):
        sched.add(_seq("a", 16, max_tokens=1))
    with pytest.raises(InvalidRequest, match="empty"):
        sched.add(Sequence("e", [], SamplingParams()))
    assert not sched.has_unfinished()
