"""The planner's pure decisions on small hand-made clusters: exact moves (which sequence, from where, to
where, how many rBlocks, why), and the step-cost fit."""

import pytest

from infinite_llm.services.manager.planner import (
    ClusterView,
    InstanceView,
    Move,
    PlannerConfig,
    SeqView,
    ServerView,
    StepCost,
    StepSample,
    apply_moves,
    fit_step_cost,
    plan,
)
from infinite_llm.services.manager.planner_moves import State, pair_gain


def _lending_cluster(b_borrows: bool) -> ClusterView:
    """A's home hA is full and 2 requests wait; B's home hB is 10% used. With ``b_borrows`` B also holds an
    rBlock on hC, a server nobody calls home."""
    servers = [ServerView("hA", 10, 0), ServerView("hB", 10, 9)]
    seqs = [SeqView("a1", "A", (("hA", 6),)), SeqView("a2", "A", (("hA", 4),)), SeqView("b1", "B", (("hB", 1),))]
    if b_borrows:
        servers.append(ServerView("hC", 4, 3))
        seqs.append(SeqView("b2", "B", (("hC", 1),)))
    instances = (
        InstanceView("A", ("hA",), num_running=2, num_waiting=2, num_tokens_held=160),
        InstanceView("B", ("hB",), num_running=1, num_waiting=0, num_tokens_held=16),
    )
    return ClusterView(tuple(servers), instances, tuple(seqs), block_size=16)


def test_debtor_lends_its_longest_sequence_to_the_creditor_by_the_best_modelled_count():
    # k=5 frees one mean sequence (80 tokens) so A admits one more; k=6 also moves attention off A's busier
    # node, which gains A more than it costs B (batch 1): 6 (of a1's 6 at home) is the best positive move.
    assert plan(_lending_cluster(b_borrows=False)) == [Move("a1", "hA", "hB", 6, "lend")]


def test_pair_gain_is_the_model_difference_of_both_instances():
    state = State(_lending_cluster(b_borrows=False))
    gain, admitted = pair_gain(state, "A", "hB", 5)
    cost = StepCost()
    a_before, a_after = 2 / cost.step_s(2, 160), 3 / cost.step_s(3, 160 - 80 + 80)
    b_before, b_after = 1 / cost.step_s(1, 16), 1 / cost.step_s(1, 16 + 80)
    assert admitted == 1
    assert gain == pytest.approx(a_after - a_before + b_after - b_before, rel=1e-12)
    assert pair_gain(state, "A", "hB", 4)[1] == 0


def test_no_chains_a_borrowing_creditor_lends_nothing_and_its_debt_comes_home():
    # B borrows on hC, so hB may not receive A's rBlocks; hC (no owner) keeps 1 of 4 in reserve. Then B, with
    # no queue and room at home, brings b2 home.
    assert plan(_lending_cluster(b_borrows=True)) == [
        Move("a1", "hA", "hC", 2, "lend"),
        Move("b2", "hC", "hB", 1, "home"),
    ]


def test_no_move_without_a_debtor_or_when_no_move_gains():
    view = _lending_cluster(b_borrows=False)
    no_queue = ClusterView(view.servers, (InstanceView("A", ("hA",), 2, 0, 160), view.instances[1]), view.seqs, 16)
    assert plan(no_queue) == []
    # Mean sequence of 160 tokens (10 rBlocks): 8 lendable rBlocks admit nobody and moving attention from A
    # (batch 1) to B (batch 1, less resident) loses more than it gains.
    big = ClusterView(view.servers, (InstanceView("A", ("hA",), 1, 2, 160), view.instances[1]), view.seqs, 16)
    assert plan(big) == []


def test_draining_server_empties_to_the_owners_home_then_a_pool_server():
    view = ClusterView(
        servers=(ServerView("s1", 8, 2, draining=True), ServerView("hA", 4, 4), ServerView("p", 8, 8)),
        instances=(InstanceView("A", ("hA",), 1, 0, 96),),
        seqs=(SeqView("x", "A", (("s1", 6),)),),
    )
    moves = plan(view)
    assert moves == [Move("x", "s1", "hA", 4, "drain"), Move("x", "s1", "p", 2, "drain")]
    after = apply_moves(view, moves)
    assert after.seqs[0].entries == (("hA", 4), ("p", 2))
    assert [s.free_blocks for s in after.servers] == [8, 0, 6]


def test_new_pool_server_after_scale_up_gets_half_the_gap():
    view = ClusterView(
        servers=(ServerView("p1", 16, 4), ServerView("p2", 16, 16)),
        instances=(),
        seqs=(SeqView("u", "", (("p1", 8),)), SeqView("v", "", (("p1", 4),))),
    )
    assert plan(view) == [Move("u", "p1", "p2", 6, "spread")]
    assert plan(view, PlannerConfig(spread_min_gap_blocks=12)) == []


def test_max_moves_bounds_a_plan():
    view = ClusterView(
        servers=(ServerView("s1", 8, 5, draining=True), ServerView("p", 8, 8)),
        instances=(),
        seqs=(SeqView("x", "", (("s1", 1),)), SeqView("y", "", (("s1", 2),))),
    )
    assert plan(view, PlannerConfig(max_moves=1)) == [Move("x", "s1", "p", 1, "drain")]
    assert plan(view) == [Move("x", "s1", "p", 1, "drain"), Move("y", "s1", "p", 2, "drain")]


def test_fit_recovers_an_exact_cost_and_falls_back_to_the_prior():
    truth = StepCost(0.01, 0.002, 3e-6)
    samples = [StepSample(b, t, truth.step_s(b, t)) for b, t in [(1, 100), (4, 100), (4, 5000), (8, 20000), (2, 700)]]
    fitted = fit_step_cost(samples, ridge=0.0)
    assert fitted.dense_base_s == pytest.approx(0.01, abs=1e-12)
    assert fitted.dense_per_seq_s == pytest.approx(0.002, abs=1e-12)
    assert fitted.attn_per_token_s == pytest.approx(3e-6, abs=1e-15)
    prior = StepCost(0.02, 0.001, 1e-6)
    assert fit_step_cost([], prior) == prior
    one = fit_step_cost([StepSample(4, 100, prior.step_s(4, 100))], prior)
    assert one.step_s(4, 100) == pytest.approx(prior.step_s(4, 100), rel=1e-6)


def test_config_rejects_bad_thresholds():
    with pytest.raises(ValueError, match="creditor_max_utilization must be in"):
        PlannerConfig(creditor_max_utilization=1.5)
    with pytest.raises(ValueError, match="max_moves must be >= 1"):
        PlannerConfig(max_moves=0)


def test_lenders_put_nobodys_servers_first_and_never_a_borrowers_home():
    from infinite_llm.services.manager.placement import choose_servers
    from infinite_llm.services.manager.planner import lenders

    view = _lending_cluster(b_borrows=True)  # B borrows on hC
    assert lenders(view, "A") == ("hC",)  # hB is B's home and B borrows: no chains
    assert lenders(view, "B") == ("hC", "hA")  # nobody's first, then A's home (A does not borrow)
    assert lenders(view, "stranger") == ("hC", "hA")  # unknown: every server the rules allow
    free = {s.server_id: s.free_blocks for s in view.servers}
    assert choose_servers(5, free, None, homes=("hB",), lenders=lenders(view, "B")) == [("hB", 5)]
    assert choose_servers(12, free, None, homes=("hB",), lenders=lenders(view, "B")) == [("hB", 9), ("hC", 3)]
    assert choose_servers(3, free, None, homes=("hA",), lenders=lenders(view, "A")) == [("hC", 3)]


def test_rblocks_on_a_server_missing_from_the_view_are_left_where_they_are():
    """A manager that just took the lead reads the ledger before every server re-registered: A's sequence
    still has rBlocks on hX, which the view does not list. Bringing them home would move them off a server
    nobody can export from now (the planner crashed on it: ``KeyError: 'hX'``); what the view knows plans
    as usual."""
    view = ClusterView(
        servers=(ServerView("hA", 8, 6), ServerView("p", 8, 4)),
        instances=(InstanceView("A", ("hA",), 1, 0, 96),),
        seqs=(SeqView("x", "A", (("hX", 5), ("p", 2))),),
    )
    assert plan(view) == [Move("x", "p", "hA", 2, "home")]
