"""``infinite-llm simulate``: a discrete-event simulator of the cluster past one machine (DESIGN.md §9).

Simulated compute instances step through request traces with step costs from a calibration file
(:mod:`.calibration`: this CPU's fitted figures, an A100-80GB or H200 from published figures); their KV is
placed by the manager's real placement code and moved by its real planner (:mod:`.simulator`,
:mod:`.planning`). :mod:`.scenarios` holds the paper's setting and a tiny one, and the paper's ratios.

Assumptions (also in the README, "The simulator"):

- Requests are routed round-robin and arrive all at time 0 (a saturated run) or as a Poisson process
  (:func:`~.traces.with_arrivals`, the open-loop search of :func:`~.scenarios.max_rate`); each instance
  admits FCFS (a head that does
  not fit blocks its queue, as vLLM's scheduler) up to ``max_num_seqs``, and reserves a request's whole
  context (prompt + output) at admission, so nothing is preempted. A request no placement could ever hold
  (static: more than the home; pooled: more than the pool) is refused. The manager's first come, first
  served order across instances (:mod:`infinite_llm.services.manager.admissions`) is not modelled.
- Throughput is output tokens per second over the saturated window (every instance has work waiting),
  leaving out the first quarter of the horizon (ramp-up). Each run also reports its regime (mean running
  batch, home KV used): the paper's pooled gain needs memory-bound instances (debtors) and instances with
  idle memory (creditors) at once; round-robin routing of one trace at saturation makes instances alike.
  Open-loop runs measure the same window and each request's queueing delay (arrival to admission).
- Step cost: ``dense(B, tokens) + max(home attention, slowest remote partial + round trips)`` plus causal
  prefill attention, roofline coefficients for GPUs (:class:`~.calibration.InstanceCost`); a server's KV
  of a sequence is its share of the sequence's rBlocks; a creditor pays the attention over what it lends.
- Instances are identical; one attention server per instance (its home: the KV memory of its accelerators).
- Migration moves ``migration_tokens_per_step`` tokens per step of the owner and costs no step time
  (the paper measured 16 tokens per step as free).
"""

from infinite_llm.sim.calibration import Calibration, InstanceCost, load_calibration
from infinite_llm.sim.simulator import SimConfig, SimResult, Simulator

__all__ = ["Calibration", "InstanceCost", "SimConfig", "SimResult", "Simulator", "load_calibration"]
