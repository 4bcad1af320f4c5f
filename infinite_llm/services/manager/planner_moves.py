"""The four kinds of move :func:`~.planner.plan` makes, over a mutable copy of the cluster view.

Each generator yields moves and applies them to :class:`State` as it goes, so the next decision sees the
cluster as it will be (PAPER.md "Cluster scheduling": apply the best move, then search again). Pure
Python; see :mod:`.planner` for the inputs, the cost model and the order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from infinite_llm.services.manager.planner import ClusterView, InstanceView, Move, PlannerConfig


@dataclass
class Load:
    """An instance's modelled load: batch, queue and tokens held, updated as moves admit its waiting work."""

    view: InstanceView
    batch: float
    waiting: float
    tokens: float

    @property
    def mean_tokens(self) -> float:
        """Tokens per running sequence (what one more admitted sequence is modelled to take)."""
        return self.tokens / self.batch if self.batch > 0 else 1.0


class State:
    """Free rBlocks per server, every sequence's shares, and each instance's load, as moves change them."""

    def __init__(self, view: ClusterView) -> None:
        self.block_size = view.block_size
        self.cap = {s.server_id: s.capacity_blocks for s in view.servers}
        self.free = {s.server_id: s.free_blocks for s in view.servers}
        self.draining = {s.server_id for s in view.servers if s.draining}
        self.loads = {
            i.instance_id: Load(i, float(i.num_running), float(i.num_waiting), float(i.num_tokens_held))
            for i in view.instances
        }
        self.homes = {i.instance_id: tuple(h for h in i.homes if h in self.cap) for i in view.instances}
        self.owners: dict[str, set[str]] = {s: set() for s in self.cap}
        for iid, homes in self.homes.items():
            for h in homes:
                self.owners[h].add(iid)
        # Shares on a server the view does not list (not yet re-registered with a new leader, or gone) stay
        # where they are: nothing can be exported from there now, and no free count exists to move them by.
        self.entries = {s.seq_id: {srv: n for srv, n in s.entries if srv in self.cap} for s in view.seqs}
        self.owner = {s.seq_id: s.owner for s in view.seqs}

    @classmethod
    def of(cls, view: ClusterView) -> State:
        return cls(view)

    # ---- reading -----------------------------------------------------------------------------------
    def used(self, server_id: str) -> int:
        return self.cap[server_id] - self.free[server_id]

    def home_free(self, iid: str) -> int:
        return sum(self.free[h] for h in self.homes[iid] if h not in self.draining)

    def home_cap(self, iid: str) -> int:
        return sum(self.cap[h] for h in self.homes[iid] if h not in self.draining)

    def resident_tokens(self, iid: str) -> float:
        return float(sum(self.used(h) for h in self.homes[iid]) * self.block_size)

    def borrowers(self) -> set[str]:
        """The instances that hold rBlocks on a server that is not one of their homes (one pass over the
        entries)."""
        out = set()
        for seq, e in self.entries.items():
            iid = self.owner[seq]
            if iid not in out and any(n > 0 and s not in self.homes.get(iid, ()) for s, n in e.items()):
                out.add(iid)
        return out

    def is_debtor(self, iid: str, config: PlannerConfig) -> bool:
        cap = self.home_cap(iid)
        load = self.loads[iid]
        return load.waiting >= 1 and cap > 0 and self.home_free(iid) <= config.debtor_max_free_fraction * cap

    def pool_servers(self) -> list[str]:
        """Servers no compute instance calls home, not draining, by id."""
        return sorted(s for s, o in self.owners.items() if not o and s not in self.draining)

    # ---- changing ----------------------------------------------------------------------------------
    def move(self, seq_id: str, src: str, dst: str, n: int, reason: str) -> Move:
        entries = self.entries[seq_id]
        assert entries.get(src, 0) >= n and self.free[dst] >= n, (seq_id, src, dst, n)
        entries[src] -= n
        if entries[src] == 0:
            del entries[src]
        entries[dst] = entries.get(dst, 0) + n
        self.free[src] += n
        self.free[dst] -= n
        return Move(seq_id, src, dst, n, reason)


# ---- drain ---------------------------------------------------------------------------------------------
def drain_moves(state: State, config: PlannerConfig, limit: int) -> Iterator[Move]:
    """Every rBlock on a draining server goes to its owner's homes first, then to servers no instance owns,
    then to servers whose owners do not borrow, most free first. What does not fit stays (the drain waits)."""
    made = 0
    for src in sorted(state.draining):
        for seq_id in sorted(s for s, e in state.entries.items() if e.get(src, 0) > 0):
            for dst in _drain_destinations(state, state.owner[seq_id]):
                n = min(state.entries[seq_id].get(src, 0), state.free[dst], config.max_move_blocks)
                if n <= 0 or made >= limit:
                    continue
                made += 1
                yield state.move(seq_id, src, dst, n, "drain")


def _drain_destinations(state: State, owner: str) -> list[str]:
    homes = [h for h in state.homes.get(owner, ()) if h not in state.draining]
    borrowers = state.borrowers()
    lenders = [s for s in state.cap if s not in state.draining and s not in homes and not state.owners[s] & borrowers]
    lenders.sort(key=lambda s: (bool(state.owners[s]), -state.free[s], s))
    return sorted(homes, key=lambda s: (-state.free[s], s)) + lenders


# ---- lend ----------------------------------------------------------------------------------------------
def lend_moves(state: State, config: PlannerConfig, limit: int) -> Iterator[Move]:
    """Debtors by ascending batch; for the first with a positive move, apply its best (creditor, k); repeat."""
    made = 0
    while made < limit:
        debtors = [i for i in sorted(state.loads) if state.is_debtor(i, config)]
        debtors.sort(key=lambda i: (state.loads[i].batch, i))
        best = None
        for d in debtors:
            best = _best_lend(state, config, d)
            if best is not None:
                break
        if best is None:
            return
        gain, seq_id, src, dst, k, admitted = best
        load = state.loads[d]
        taken = admitted * load.mean_tokens
        load.batch, load.waiting, load.tokens = load.batch + admitted, load.waiting - admitted, load.tokens + taken
        made += 1
        yield state.move(seq_id, src, dst, k, "lend")
        _admit(state, d, taken)


def _admit(state: State, iid: str, tokens: float) -> None:
    """The admitted sequences take home memory (modelled): off the most free homes."""
    need = math.ceil(tokens / state.block_size)
    for h in sorted(state.homes[iid], key=lambda s: (-state.free[s], s)):
        take = min(need, state.free[h])
        state.free[h] -= take
        need -= take


def _longest_at_home(state: State, iid: str) -> tuple[str, str] | None:
    """(seq_id, home server holding most of it) of ``iid``'s longest sequence with rBlocks at home."""
    homes = [h for h in state.homes[iid] if h not in state.draining]
    best = None
    for seq_id, e in state.entries.items():
        if state.owner[seq_id] != iid or not any(e.get(h, 0) for h in homes):
            continue
        key = (sum(e.values()), seq_id)
        if best is None or key[0] > best[0][0] or (key[0] == best[0][0] and key[1] < best[0][1]):
            src = max(homes, key=lambda h: (e.get(h, 0), h))
            best = (key, src)
    return None if best is None else (best[0][1], best[1])


def creditors_for(state: State, config: PlannerConfig, debtor: str) -> list[tuple[str, int]]:
    """``[(server_id, lendable rBlocks)]`` a debtor may borrow from: not its home, not draining, owned by
    nobody or by instances that neither borrow (no chains) nor use more than ``creditor_max_utilization``."""
    out, borrowers = [], state.borrowers()
    for s in sorted(state.cap):
        if s in state.draining or s in state.homes[debtor]:
            continue
        owners = state.owners[s]
        if any(o in borrowers for o in owners):
            continue
        if any(_utilization(state, o) > config.creditor_max_utilization for o in owners):
            continue
        lendable = state.free[s] - math.ceil(config.creditor_reserve_fraction * state.cap[s])
        if lendable > 0:
            out.append((s, lendable))
    return out


def _utilization(state: State, iid: str) -> float:
    cap = state.home_cap(iid)
    return 1.0 - state.home_free(iid) / cap if cap else 1.0


def _best_lend(state: State, config: PlannerConfig, d: str) -> tuple[float, str, str, str, int, int] | None:
    longest = _longest_at_home(state, d)
    if longest is None:
        return None
    seq_id, src = longest
    on_src = state.entries[seq_id][src]
    best = None
    debtor_gains: list[tuple[float, int]] = [(0.0, 0)]  # [k]: the debtor's term of pair_gain, the same for every dst
    for dst, lendable in creditors_for(state, config, d):
        owners = [(state.loads[o], state.resident_tokens(o)) for o in state.owners[dst]]
        for k in range(1, min(on_src, lendable, config.max_move_blocks) + 1):
            if k == len(debtor_gains):
                debtor_gains.append(_debtor_gain(state, d, k))
            gain, admitted = _owners_gain(state, owners, k, *debtor_gains[k])
            if gain > 1e-12 and (best is None or gain > best[0]):
                best = (gain, seq_id, src, dst, k, admitted)
    return best


def pair_gain(state: State, debtor: str, dst: str, k: int) -> tuple[float, int]:
    """Modelled tokens/s gained by the debtor plus ``dst``'s owners when ``k`` rBlocks of the debtor move to
    ``dst``, and how many waiting sequences the debtor admits with the memory freed.

    The debtor admits ``floor(free_tokens / mean_tokens)`` more sequences (at most its queue) and its
    resident tokens drop by the ``k`` rBlocks; each owner of ``dst`` keeps its batch and gains ``k`` rBlocks
    of resident tokens (their attention runs on its node).
    """
    owners = [(state.loads[o], state.resident_tokens(o)) for o in state.owners[dst]]
    return _owners_gain(state, owners, k, *_debtor_gain(state, debtor, k))


def _debtor_gain(state: State, debtor: str, k: int) -> tuple[float, int]:
    """The debtor's term of :func:`pair_gain`, and the sequences it admits."""
    bs = state.block_size
    load = state.loads[debtor]
    free_before = state.home_free(debtor) * bs
    admitted = min(int(load.waiting), int((free_before + k * bs) // load.mean_tokens)) - min(
        int(load.waiting), int(free_before // load.mean_tokens)
    )
    r = state.resident_tokens(debtor)
    cost = load.view.cost
    gain = cost.throughput(load.batch + admitted, r - k * bs + admitted * load.mean_tokens) - cost.throughput(
        load.batch, r
    )
    return gain, admitted


def _owners_gain(
    state: State, owners: list[tuple[Load, float]], k: int, gain: float, admitted: int
) -> tuple[float, int]:
    """:func:`pair_gain` from the debtor's term: plus each owner's ``(load, resident tokens)`` term, in order."""
    bs = state.block_size
    for lo, ro in owners:
        gain += lo.view.cost.throughput(lo.batch, ro + k * bs) - lo.view.cost.throughput(lo.batch, ro)
    return gain, admitted


# ---- home and spread -----------------------------------------------------------------------------------
def home_moves(state: State, config: PlannerConfig, limit: int) -> Iterator[Move]:
    """An instance with no queue brings its rBlocks home while its homes keep ``home_headroom_fraction`` free:
    its sequences with the most rBlocks away first."""
    made = 0
    for iid in sorted(state.loads):
        if state.loads[iid].waiting >= 1:
            continue
        homes = [h for h in state.homes[iid] if h not in state.draining]
        away = [
            (n, seq_id, s)
            for seq_id, e in state.entries.items()
            if state.owner[seq_id] == iid
            for s, n in e.items()
            if s not in homes
        ]
        for n, seq_id, src in sorted(away, key=lambda a: (-a[0], a[1], a[2])):
            room = state.home_free(iid) - math.ceil(config.home_headroom_fraction * state.home_cap(iid))
            dst = max(homes, key=lambda h: (state.free[h], h), default=None)
            k = min(n, room, config.max_move_blocks, state.free[dst] if dst else 0)
            if dst is None or k <= 0 or made >= limit:
                break
            made += 1
            yield state.move(seq_id, src, dst, k, "home")


def spread_moves(state: State, config: PlannerConfig, limit: int) -> Iterator[Move]:
    """Level the servers no instance owns (new after a scale-up): from the most used to the least used, half
    the gap at a time, while the gap exceeds ``spread_min_gap_blocks``."""
    made = 0
    while made < limit:
        pool = state.pool_servers()
        if len(pool) < 2:
            return
        src = max(pool, key=lambda s: (state.used(s), s))
        dst = min(pool, key=lambda s: (state.used(s), s))
        gap = state.used(src) - state.used(dst)
        if gap <= config.spread_min_gap_blocks:
            return
        held = [s for s, e in state.entries.items() if e.get(src, 0)]
        if not held:  # what the server holds is not in the ledger: nothing to move
            return
        seq_id = max(held, key=lambda s: (state.entries[s][src], s))
        k = min(state.entries[seq_id][src], gap // 2, state.free[dst], config.max_move_blocks)
        if k <= 0:
            return
        made += 1
        yield state.move(seq_id, src, dst, k, "spread")
