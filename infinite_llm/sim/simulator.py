"""The discrete-event simulator: compute instances stepping over simulated KV, placed by the real manager code.

Each compute instance is a continuous-batching engine (vLLM-like: FCFS queue, head-of-line admission,
chunked prefill under ``max_num_batched_tokens`` mixed with the batch's decodes) whose step times come from
an :class:`~infinite_llm.sim.calibration.InstanceCost`. What is real:

- placement: every admitted sequence's rBlocks are reserved with the manager's own
  :func:`~infinite_llm.services.manager.placement.reserve_placement` over a real
  :class:`~infinite_llm.services.manager.capacity.CapacityView` and :class:`~.cluster.SimServers`
  (``static``: home only, lenders ``()``; ``pooled``: home first, then the planner's
  :func:`~infinite_llm.services.manager.planner.lenders`, or every server with the planner off);
- the planner: in ``pooled`` mode every ``planner_interval_s`` the manager's
  :func:`~infinite_llm.services.manager.planner.plan` runs on a :class:`ClusterView` of the simulated
  cluster, with each instance's :class:`StepCost` fitted by the real
  :func:`~infinite_llm.services.manager.planner.fit_step_cost` from its own step timings; each move is a
  reservation on the destination, then a transfer metered at ``migration_tokens_per_step`` tokens per step
  of the owner, then the flip (commit on the destination, release on the source).

Time advances by events: an instance's next step (decode steps of a stable batch are taken together, up to
``tick_s`` of simulated time, their cost integrated exactly for the linear growth of the KV), a planner run,
a migration's end. Deterministic: no wall clock, no randomness past the trace. The assumptions are listed in
:mod:`infinite_llm.sim` and the README ("The simulator").
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from infinite_llm.core.config import DEFAULT_BLOCK_SIZE
from infinite_llm.core.errors import CapacityExhausted
from infinite_llm.services.manager.capacity import CapacityView
from infinite_llm.services.manager.placement import reserve_placement
from infinite_llm.services.manager.planner import StepSample
from infinite_llm.sim.calibration import InstanceCost
from infinite_llm.sim.cluster import Instance, KVTokens, SimSeq, SimServers
from infinite_llm.sim.planning import PlannerDriver
from infinite_llm.sim.traces import Request


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster. ``mode``: ``pooled`` (KV anywhere) or ``static`` (KV on the home only);
    one instance in ``static`` mode is the one-big-instance baseline. ``admit_bypass_s``: how long (seconds
    since its arrival) a queue head that does not fit lets the requests behind it that fit pass (0: strict
    FCFS, as vLLM's scheduler)."""

    mode: str
    num_instances: int
    cost: InstanceCost
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    tick_s: float = 0.25
    planner: bool = True
    planner_interval_s: float = 1.0
    migration_tokens_per_step: int = 16
    admit_bypass_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("pooled", "static"):
            raise ValueError(f"mode must be pooled or static, got {self.mode!r}")
        if self.admit_bypass_s < 0:
            raise ValueError(f"admit_bypass_s must be >= 0 seconds, got {self.admit_bypass_s}")
        if self.num_instances < 1 or self.block_size < 1 or self.max_num_seqs < 1 or self.tick_s <= 0:
            raise ValueError(f"bad simulator config {self}")

    @property
    def capacity_blocks(self) -> int:
        return self.cost.kv_capacity_tokens // self.block_size


@dataclass(frozen=True)
class SimResult:
    """What one run produced, in tokens and seconds of simulated time.

    Throughput is measured over the saturated window: until the horizon or the first instance's queue ran
    empty (every instance had work waiting until then), so one request's decode tail does not decide it;
    with a horizon, its first quarter (the ramp-up: every instance prefilling its first batch) is left out.
    ``window_s``/``window_tokens``: that window and the output tokens decoded in it; ``makespan_s``: the
    last completion when the run went on to the end, else the window's end.

    ``mean_batch`` (running sequences per instance) and ``home_used`` (used fraction of each instance's home
    rBlocks, every owner's) are averaged over the instances' step time after the ramp-up. They tell the
    regime: a batch at ``max_num_seqs`` with home memory to spare is batch-capped (it could lend, a creditor
    in PAPER.md's terms), a batch far below it with a full home is memory-bound (a debtor).

    ``wait_mean_s`` / ``wait_p90_s``: queueing delay (arrival to admission, seconds) of the requests that
    arrived after the ramp-up, those still queued at the end counted with their wait so far (a lower
    bound); refused requests are left out. 0 when none arrived after the ramp-up. ``backlog``: how many of
    them were still queued at the end (a share that grows with the horizon means the rate is not sustained).
    """

    window_tokens: int
    window_prompt_tokens: int
    window_s: float
    output_tokens: int
    makespan_s: float
    served: int
    refused: int
    longest_context: int
    migrations: int
    migrated_blocks: int
    events: int
    mean_batch: float = 0.0
    home_used: float = 0.0
    wait_mean_s: float = 0.0
    wait_p90_s: float = 0.0
    backlog: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Over the window; over the whole run if the window closed at once (a queue empty at time 0)."""
        if self.window_s > 0:
            return self.window_tokens / self.window_s
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def all_tokens_per_s(self) -> float:
        """Prompt tokens prefilled plus output tokens decoded per second, over the window."""
        return (self.window_tokens + self.window_prompt_tokens) / self.window_s if self.window_s > 0 else 0.0


class Simulator:
    """Run ``requests`` (routed round-robin in order, each at its ``arrival_s``) on the cluster of ``config``.

    Closed run (every request at time 0): the run stops at the end of the saturated window (the first
    instance's queue ran empty, or ``horizon_s`` of simulated time), or with ``to_completion`` when every
    request is done. Open-loop run (arrival times from :func:`~infinite_llm.sim.traces.with_arrivals`):
    queues may run empty and refill, so the window is the ramp-up's end to ``horizon_s`` (or the last
    completion), and the result carries the queueing delays.
    """

    def __init__(
        self, config: SimConfig, requests: list[Request], horizon_s: float = math.inf, to_completion: bool = False
    ) -> None:
        self.config = config
        self.horizon_s = horizon_s
        self.warmup_s = horizon_s / 4 if math.isfinite(horizon_s) else math.inf  # ramp-up left out
        self.wait_from_s = self.warmup_s if math.isfinite(horizon_s) else 0.0  # arrivals whose wait counts
        self.warm: tuple[int, int, float] | None = None  # (output, prompt tokens, time) at the warm-up's end
        self.to_completion = to_completion
        self.window: tuple[int, int, float] | None = None  # (output, prompt tokens, time) when a queue ran empty
        n = config.num_instances
        self.instances = [Instance(i, f"c{i}", f"s{i}") for i in range(n)]
        self.open_loop = any(req.arrival_s > 0 for req in requests)
        self._events: list[tuple[float, int, str, object]] = []
        self._seqno = 0
        self.arrivals_left = 0
        for k, req in enumerate(requests):
            if req.arrival_s > 0:
                self.schedule(req.arrival_s, "arrive", (self.instances[k % n], req))
                self.arrivals_left += 1
            else:
                self.instances[k % n].queue.append(req)
        self.waits: list[float] = []  # queueing delays of requests admitted that arrived after the ramp-up
        self.servers = SimServers({i.home: config.capacity_blocks for i in self.instances})
        self.view = CapacityView()
        for i in self.instances:
            self.view.add(i.home, config.capacity_blocks)
        self.kv = KVTokens(list(self.servers.capacity), [i.home for i in self.instances])
        self.planner = PlannerDriver(self) if config.mode == "pooled" and config.planner else None
        self.now = 0.0
        self.output_tokens = self.prompt_tokens = self.served = self.refused = self.longest = self.events = 0
        self.makespan = 0.0
        self.seqs: dict[str, SimSeq] = {}  # running sequences by id
        # step seconds, batch x seconds, home used fraction x seconds: over the whole run, and after the ramp-up
        self._regime = {"all": [0.0, 0.0, 0.0], "warm": [0.0, 0.0, 0.0]}

    def schedule(self, at: float, kind: str, payload: object) -> None:
        self._seqno += 1
        heapq.heappush(self._events, (at, self._seqno, kind, payload))

    async def run(self) -> SimResult:
        if self.planner is not None:
            await self.planner.tick(0.0)
            self.schedule(self.config.planner_interval_s, "plan", None)
        await self._start_together()
        for inst in self.instances:
            self.schedule(0.0, "step", inst)
        while self._events and (self.window is None or self.to_completion):
            if self._events[0][0] >= self.warmup_s and self.warm is None:
                self.warm = (self.output_tokens, self.prompt_tokens, self.warmup_s)
            if self._events[0][0] >= self.horizon_s and self.window is None:
                self.window = (self.output_tokens, self.prompt_tokens, self.horizon_s)
                break
            self.now, _, kind, payload = heapq.heappop(self._events)
            self.events += 1
            if kind == "step":
                await self._step(payload)
            elif kind == "arrive":
                self._arrive(*payload)
            elif kind == "plan" and (self._busy() or self.arrivals_left):
                await self.planner.tick(self.now)
                self.schedule(self.now + self.config.planner_interval_s, "plan", None)
            elif kind == "migrated":
                self.planner.finish(payload)
        moved = self.planner.stats if self.planner is not None else (0, 0)
        end_out, end_prompt, end_s = self.window or (self.output_tokens, self.prompt_tokens, self.makespan)
        start = self.warm if self.warm is not None and self.warm[2] < end_s else (0, 0, 0.0)
        window_tokens, window_prompt, window_s = end_out - start[0], end_prompt - start[1], end_s - start[2]
        makespan = self.makespan if self.to_completion else window_s
        seconds, batch_s, used_s = self._regime["warm" if start[2] > 0 else "all"]
        queued = [
            end_s - r.arrival_s for i in self.instances for r in i.queue if self.wait_from_s <= r.arrival_s <= end_s
        ]
        waits = sorted(self.waits + queued)
        return SimResult(
            window_tokens,
            window_prompt,
            window_s,
            self.output_tokens,
            makespan,
            self.served,
            self.refused,
            self.longest,
            *moved,
            self.events,
            batch_s / seconds if seconds else 0.0,
            used_s / seconds if seconds else 0.0,
            sum(waits) / len(waits) if waits else 0.0,
            waits[math.ceil(0.9 * len(waits)) - 1] if waits else 0.0,  # nearest rank
            len(queued),
        )

    def _arrive(self, inst: Instance, req: Request) -> None:
        """``req`` joins ``inst``'s queue; an idle instance steps at once."""
        self.arrivals_left -= 1
        inst.queue.append(req)
        if inst.idle:
            inst.idle = False
            self.schedule(self.now, "step", inst)

    async def _start_together(self) -> None:
        """At time 0 the instances admit one request each in turn, as if they started at once (else the
        first would fill the pool before the others start)."""
        cap, progress = self.config.max_num_seqs, True
        while progress:
            progress = False
            for inst in self.instances:
                before = len(inst.running) + self.refused
                await self._admit(inst, limit=min(len(inst.running) + 1, cap))
                progress |= len(inst.running) + self.refused > before

    def _busy(self) -> bool:
        return any(i.queue or i.running for i in self.instances)

    # ---- admission ---------------------------------------------------------------------------------
    async def _admit(self, inst: Instance, limit: int | None = None) -> None:
        """Admit the queue's head while it can be placed (FCFS: a head that does not fit now blocks), up to
        ``limit`` running sequences (default ``max_num_seqs``). With ``admit_bypass_s``, while a head that
        does not fit has waited less than that, the requests behind it that fit are admitted past it."""
        limit = self.config.max_num_seqs if limit is None else limit
        while inst.queue and len(inst.running) < limit:
            req = inst.queue[0]
            n_blocks = math.ceil(req.context_tokens / self.config.block_size)
            if n_blocks > self._reachable_capacity(inst):
                self._dequeue(inst, req)
                self.refused += 1
                continue
            blocks = await self._place(inst, req.req_id, n_blocks)
            if blocks is None:
                if self.now - req.arrival_s < self.config.admit_bypass_s:
                    await self._bypass(inst, limit)
                return
            self._start(inst, req, blocks)

    async def _bypass(self, inst: Instance, limit: int) -> None:
        """Admit the requests behind the head that fit now, in order, up to ``limit`` running. A request larger
        than the free rBlocks it could reach is skipped without asking the placement (a saturated queue is
        long)."""
        free = self.view.free_blocks()
        reachable = free[inst.home] if self.config.mode == "static" else sum(free.values())
        for req in list(inst.queue)[1:]:
            if len(inst.running) >= limit or reachable <= 0:
                return
            n_blocks = math.ceil(req.context_tokens / self.config.block_size)
            if n_blocks > reachable:
                continue  # too large now (or ever: refused when it reaches the head)
            blocks = await self._place(inst, req.req_id, n_blocks)
            if blocks is not None:
                self._start(inst, req, blocks)
                reachable -= n_blocks

    def _start(self, inst: Instance, req: Request, blocks: dict[str, int]) -> None:
        """``req`` leaves the queue and runs on its placed ``blocks``."""
        self._dequeue(inst, req)
        if req.arrival_s >= self.wait_from_s:
            self.waits.append(self.now - req.arrival_s)
        seq = SimSeq(req, inst.index, blocks)
        inst.running.append(seq)
        inst.prefills.append(seq)
        self.seqs[seq.seq_id] = seq

    def _dequeue(self, inst: Instance, req: Request) -> None:
        if inst.queue[0] is req:
            inst.queue.popleft()
        else:
            inst.queue.remove(req)
        if not inst.queue and self.window is None and not self.open_loop:
            self.window = (self.output_tokens, self.prompt_tokens, self.now)

    def _reachable_capacity(self, inst: Instance) -> int:
        if self.config.mode == "static":
            return self.servers.capacity[inst.home]
        return sum(self.servers.capacity.values())

    async def _place(self, inst: Instance, seq_id: str, n_blocks: int) -> dict[str, int] | None:
        """Reserve and commit ``n_blocks`` through the real placement; ``None`` if they do not fit now."""
        if self.config.mode == "static" or self.view.free_blocks()[inst.home] >= n_blocks:
            lenders: tuple[str, ...] | None = ()  # home only (static), or home holds it: no lender is asked
        else:
            lenders = None if self.planner is None else self.planner.lenders_of(inst.instance_id)
        try:
            held = await reserve_placement(
                self.servers, self.view, seq_id, n_blocks, inst.home, homes=(inst.home,), lenders=lenders
            )
        except CapacityExhausted:
            return None
        blocks: dict[str, int] = {}
        for h in held:
            await self.servers.commit(h.server_id, h.reservation.reservation_id, list(range(h.n_blocks)))
            blocks[h.server_id] = blocks.get(h.server_id, 0) + h.n_blocks
        return blocks

    # ---- steps -------------------------------------------------------------------------------------
    async def _step(self, inst: Instance) -> None:
        await self._admit(inst)
        if not inst.running:
            if inst.queue:  # the head waits for memory to free elsewhere
                self.schedule(self.now + self.config.tick_s, "step", inst)
            else:
                inst.idle = True
            return
        if inst.prefills:
            duration, steps = self._prefill_step(inst), 1
        else:
            batch, resident = len(inst.running), self.kv.on[inst.home]
            duration, steps = self._decode_steps(inst)
            inst.samples.append(StepSample(batch, resident, duration / steps))  # what the planner fits
        inst.last_step_s = duration / steps
        used = self.servers.used(inst.home) / self.servers.capacity[inst.home]
        for key in ("all", "warm") if self.now >= self.warmup_s else ("all",):
            acc = self._regime[key]
            acc[0] += duration
            acc[1] += len(inst.running) * duration
            acc[2] += used * duration
        await self._retire(inst, self.now + duration)
        self.schedule(self.now + duration, "step", inst)

    def _attention_s(self, inst: Instance, batch: int, growth_home: float, growth_away: float) -> float:
        """Decode attention of a step: the home's KV (every owner's) on this instance's accelerators, in
        parallel with the partials of this instance's KV on other servers (plus their round trips)."""
        cost = self.config.cost
        local = cost.decode_attn_s(self.kv.on[inst.home] + growth_home, batch)
        away = self.kv.away[inst.index]
        if not away:
            return local
        remote = cost.decode_attn_s(max(away.values()) + growth_away, 1) + cost.remote_wait_s(batch)
        return max(local, remote)

    def _decode_steps(self, inst: Instance) -> tuple[float, int]:
        """Take ``k`` decode steps of the stable batch at once: until a sequence finishes or ``tick_s``.
        The KV grows by one token per sequence per step, so the mean step is the step at the midpoint."""
        cost, batch = self.config.cost, len(inst.running)
        grow_home = sum(s.fraction(inst.home) for s in inst.running)
        away = self.kv.away[inst.index]
        widest = max(away, key=away.__getitem__) if away else None  # the remote partial the step waits for
        grow_away = sum(s.fraction(widest) for s in inst.running) if widest else 0.0
        first = cost.dense_s(batch, batch) + self._attention_s(inst, batch, 0.0, 0.0)
        left = min(s.req.output_tokens - s.generated for s in inst.running)
        k = max(1, min(left, int(self.config.tick_s / first)))
        mid = (k - 1) / 2
        mean = cost.dense_s(batch, batch) + self._attention_s(inst, batch, grow_home * mid, grow_away * mid)
        for s in inst.running:
            s.generated += k
            s.computed += k
            self.kv.add(s, k)
        self.output_tokens += k * batch
        return k * mean, k

    def _prefill_step(self, inst: Instance) -> float:
        """One step: every decoding sequence's next token, and prefill chunks (FCFS) in the token budget."""
        cost = self.config.cost
        decoding = [s for s in inst.running if not s.prefilling]
        budget = self.config.max_num_batched_tokens - len(decoding)
        prefill_s, chunks = 0.0, 0
        for s in inst.prefills:
            if budget <= 0:
                break
            chunk = min(budget, s.req.prompt_tokens - s.computed)
            widest = max(s.blocks.values()) / s.num_blocks  # holders attend in parallel: the widest share waits
            prefill_s += cost.prefill_attn_s(chunk * (s.computed + chunk / 2) * widest)
            budget -= chunk
            chunks += chunk
            self.prompt_tokens += chunk
            s.computed += chunk
            self.kv.add(s, chunk)
            if not s.prefilling:
                s.generated = 1  # the last chunk's logits give the first token
                self.output_tokens += 1
        inst.prefills = [s for s in inst.prefills if s.prefilling]
        step = cost.dense_s(len(inst.running), len(decoding) + chunks) + prefill_s
        if decoding:
            step += self._attention_s(inst, len(decoding), 0.0, 0.0)
        for s in decoding:
            s.generated += 1
            s.computed += 1
            self.kv.add(s, 1)
        self.output_tokens += len(decoding)
        return step

    async def _retire(self, inst: Instance, end: float) -> None:
        """Free the rBlocks of finished sequences (the real servers' free, the view's give_back)."""
        done = [s for s in inst.running if s.generated >= s.req.output_tokens]
        if not done:
            return
        inst.running = [s for s in inst.running if s.generated < s.req.output_tokens]
        for s in done:
            self.kv.add(s, -s.computed)
            for server_id in s.blocks:
                self.view.give_back(server_id, await self.servers.free(server_id, s.seq_id))
            s.blocks = {}
            del self.seqs[s.seq_id]
            self.served += 1
            self.longest = max(self.longest, s.req.context_tokens)
        self.makespan = max(self.makespan, end)
