"""The gManager's memory planner: which rBlocks to move where. Pure decisions: dataclasses in, moves out.

PAPER.md "Cluster scheduling": debtors are compute instances whose batch is held down by memory (requests
wait while their home servers are full), creditors are instances with spare home memory (or attention
servers no instance calls home). Debtors are taken by ascending batch size; for each, its longest sequence;
for each creditor, the number of rBlocks whose move most improves the pair's modelled throughput under a
per-step cost model (:class:`StepCost`: a batch-dependent dense term plus a resident-token attention term,
fitted from the instances' step timings by :func:`fit_step_cost`). The best positive move is applied to the
view and the search repeats until no move gains. Besides lending, :func:`plan` brings rBlocks home when
home space frees, spreads them onto servers no instance owns (new after a scale-up), and empties draining
servers. No chains: a server whose owner is itself borrowing never receives a lent rBlock.

No etcd, no gRPC, no clock: :class:`~.manager.GlobalManager` builds a :class:`ClusterView` from its ledger,
capacity view and heartbeats, and executes each :class:`Move` as reserve on the destination, fenced ledger
update, transfer; the simulator (``infinite-llm simulate``) drives the same function on simulated instances.

Inputs and outputs (all sizes in rBlocks, times in seconds):

- :class:`ServerView`: an attention server's ``capacity_blocks``, ``free_blocks`` and ``draining`` flag.
- :class:`InstanceView`: a compute instance's ``homes`` (server ids), ``num_running`` (its batch),
  ``num_waiting`` (its queue), ``num_tokens_held`` and its fitted :class:`StepCost`.
- :class:`SeqView`: one sequence of the ledger: ``owner`` (instance id, '' when unknown) and ``entries``
  ``((server_id, n_blocks), ...)``.
- :class:`PlannerConfig`: thresholds; see its fields.
- :func:`plan` returns ``list[Move]`` in execution order; each :class:`Move` is ``(seq_id, src, dst,
  n_blocks, reason)`` with ``reason`` one of ``"drain"``, ``"lend"``, ``"home"``, ``"spread"``. Moves are
  planned against a copy of the view in which earlier moves already happened, so they compose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE

REASONS = ("drain", "lend", "home", "spread")


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds of one decode step of an instance: ``dense_base_s + dense_per_seq_s * batch +
    attn_per_token_s * resident_tokens``.

    ``resident_tokens`` are the tokens whose KV sits on the instance's home servers (its own and any it
    lends): a home server shares the instance's node, so their attention work shares its accelerator
    (PAPER.md: ``T = T_dense(B) + T_attn(tokens resident)``).
    """

    dense_base_s: float = 0.02
    dense_per_seq_s: float = 0.0005
    attn_per_token_s: float = 1e-6

    def step_s(self, batch: float, resident_tokens: float) -> float:
        return self.dense_base_s + self.dense_per_seq_s * batch + self.attn_per_token_s * resident_tokens

    def throughput(self, batch: float, resident_tokens: float) -> float:
        """Modelled output tokens per second: one token per running sequence per step."""
        return batch / self.step_s(batch, resident_tokens) if batch > 0 else 0.0


@dataclass(frozen=True)
class StepSample:
    """One observed decode interval: mean ``step_s`` seconds at ``batch`` sequences holding ``tokens``."""

    batch: float
    tokens: float
    step_s: float


def fit_step_cost(samples: Sequence[StepSample], prior: StepCost = StepCost(), ridge: float = 1e-3) -> StepCost:
    """Least-squares fit of :class:`StepCost` to ``samples``, shrunk towards ``prior``.

    Solves ``min sum (c0 + c1*b + c2*t - s)^2 + ridge * n * |c - prior|^2`` (each coefficient scaled by the
    sample spread), so two samples or samples without variation in batch or tokens give the prior's
    coefficient where the data says nothing. Coefficients are clamped at >= 0 (a step never gets cheaper
    with more work). Empty ``samples`` returns ``prior``.
    """
    if not samples:
        return prior
    n = len(samples)
    scale = [1.0, max(max(s.batch for s in samples), 1.0), max(max(s.tokens for s in samples), 1.0)]
    rows = [[1.0, s.batch / scale[1], s.tokens / scale[2]] for s in samples]
    p = [prior.dense_base_s, prior.dense_per_seq_s * scale[1], prior.attn_per_token_s * scale[2]]
    lam = ridge * n
    a = [[sum(r[i] * r[j] for r in rows) + (lam if i == j else 0.0) for j in range(3)] for i in range(3)]
    b = [sum(r[i] * s.step_s for r, s in zip(rows, samples, strict=True)) + lam * p[i] for i in range(3)]
    c = _solve3(a, b)
    return StepCost(max(c[0], 0.0), max(c[1] / scale[1], 0.0), max(c[2] / scale[2], 0.0))


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a 3x3 system (the ridge term keeps it regular)."""
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col and m[col][col] != 0.0:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][3] / m[i][i] if m[i][i] != 0.0 else 0.0 for i in range(3)]


@dataclass(frozen=True)
class ServerView:
    """An attention server: ``capacity_blocks`` and estimated ``free_blocks`` (rBlocks); ``draining``: the
    autoscaler is removing it (every rBlock must leave, none may arrive)."""

    server_id: str
    capacity_blocks: int
    free_blocks: int
    draining: bool = False


@dataclass(frozen=True)
class InstanceView:
    """A compute instance: its home server ids, batch (``num_running``), queue (``num_waiting``), tokens
    its running sequences hold, and its fitted step cost."""

    instance_id: str
    homes: tuple[str, ...]
    num_running: int = 0
    num_waiting: int = 0
    num_tokens_held: int = 0
    cost: StepCost = field(default_factory=StepCost)


@dataclass(frozen=True)
class SeqView:
    """One sequence of the ledger: ``owner`` instance id ('' unknown) and ``((server_id, n_blocks), ...)``."""

    seq_id: str
    owner: str
    entries: tuple[tuple[str, int], ...]

    @property
    def num_blocks(self) -> int:
        return sum(n for _, n in self.entries)

    def on(self, server_id: str) -> int:
        return sum(n for s, n in self.entries if s == server_id)


@dataclass(frozen=True)
class ClusterView:
    """Everything :func:`plan` reads: servers, compute instances and the ledger's sequences."""

    servers: tuple[ServerView, ...]
    instances: tuple[InstanceView, ...]
    seqs: tuple[SeqView, ...]
    block_size: int = DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class PlannerConfig:
    """Thresholds of :func:`plan`.

    Attributes:
        debtor_max_free_fraction: an instance with waiting requests is a debtor when its homes' free
            rBlocks are at most this fraction of their capacity (its batch is held down by memory).
        creditor_max_utilization: an instance lends when its homes' used fraction is at most this.
        creditor_reserve_fraction: of a creditor's home capacity, this fraction stays free for its own growth.
        home_headroom_fraction: rBlocks are brought home only while this fraction of home capacity stays free.
        spread_min_gap_blocks: servers no instance owns are levelled while used rBlocks differ by more.
        max_move_blocks: rBlocks of one move at most (a migration holds its reservation until the flip).
        max_moves: moves per :func:`plan` call at most.
    """

    debtor_max_free_fraction: float = 0.05
    creditor_max_utilization: float = 0.7
    creditor_reserve_fraction: float = 0.1
    home_headroom_fraction: float = 0.2
    spread_min_gap_blocks: int = 4
    max_move_blocks: int = 64
    max_moves: int = 16

    def __post_init__(self) -> None:
        for name in (
            "debtor_max_free_fraction",
            "creditor_max_utilization",
            "creditor_reserve_fraction",
            "home_headroom_fraction",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("spread_min_gap_blocks", "max_move_blocks", "max_moves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Move:
    """Move ``n_blocks`` rBlocks of ``seq_id`` from server ``src`` to server ``dst``, for ``reason``."""

    seq_id: str
    src: str
    dst: str
    n_blocks: int
    reason: str

    def __post_init__(self) -> None:
        if self.n_blocks < 1 or self.src == self.dst or self.reason not in REASONS:
            raise ValueError(f"bad move {self}")


def plan(view: ClusterView, config: PlannerConfig = PlannerConfig()) -> list[Move]:
    """The moves that rebalance ``view``, in order: drains first, then lending (debtor -> creditor), then
    bringing rBlocks home, then spreading over servers no instance owns. At most ``config.max_moves``."""
    from infinite_llm.services.manager.planner_moves import State, drain_moves, home_moves, lend_moves, spread_moves

    state = State.of(view)
    moves: list[Move] = []
    for step in (drain_moves, lend_moves, home_moves, spread_moves):
        for move in step(state, config, config.max_moves - len(moves)):
            moves.append(move)
        if len(moves) >= config.max_moves:
            break
    return moves[: config.max_moves]


def apply_moves(view: ClusterView, moves: Sequence[Move]) -> ClusterView:
    """``view`` after ``moves`` (free counts and ledger entries updated), for callers that simulate them."""
    free = {s.server_id: s.free_blocks for s in view.servers}
    seqs = {s.seq_id: dict(s.entries) for s in view.seqs}
    for m in moves:
        entries = seqs[m.seq_id]
        entries[m.src] = entries.get(m.src, 0) - m.n_blocks
        entries[m.dst] = entries.get(m.dst, 0) + m.n_blocks
        free[m.src] += m.n_blocks
        free[m.dst] -= m.n_blocks
    return replace(
        view,
        servers=tuple(replace(s, free_blocks=free[s.server_id]) for s in view.servers),
        seqs=tuple(replace(s, entries=tuple((k, n) for k, n in seqs[s.seq_id].items() if n > 0)) for s in view.seqs),
    )


def lenders(view: ClusterView, instance_id: str) -> tuple[str, ...]:
    """Servers a new rBlock of ``instance_id`` may go to once its homes are full, best first.

    Not its homes, not draining, and no server whose owner is itself borrowing (no chains, PAPER.md
    "Managers"); servers no instance calls home first, then by most free rBlocks, ties by id. An instance
    unknown to ``view`` may use every server that passes the same rules.
    """
    from infinite_llm.services.manager.planner_moves import State

    state = State.of(view)
    homes = set(state.homes.get(instance_id, ()))
    borrowers = state.borrowers()
    allowed = [s for s in state.cap if s not in homes and s not in state.draining and not state.owners[s] & borrowers]
    return tuple(sorted(allowed, key=lambda s: (bool(state.owners[s]), -state.free[s], s)))
