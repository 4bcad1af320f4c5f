"""Calibration files and the per-step cost model of a simulated compute instance.

A calibration is a YAML file under ``infinite_llm/sim/calibrations/`` (or any path) of one of two kinds:

- ``hardware``: an accelerator's published figures (memory, HBM bandwidth, dense bf16 FLOP/s) with
  efficiency factors and latencies; :meth:`Calibration.instance_cost` derives a roofline step cost for any
  model and tensor/pipeline-parallel shape (``a100_80gb.yaml``, ``h200.yaml``).
- ``fitted``: step-cost coefficients fitted by :func:`fit_coefficients` to measurements of this project's
  engine on one model (``cpu_smollm2_135m.yaml``: the README's CPU benchmark figures); the file keeps the
  measurements beside the coefficients so the fit can be checked.

The cost model (PAPER.md "Cluster scheduling": ``T = T_dense(B) + T_attn(tokens resident) + T_net``), per
step of an instance with ``B`` sequences and ``n`` tokens (decode tokens plus prefill-chunk tokens)::

    dense  = fixed_s + seq_s * B + max(weights_s, token_s * n / min(pp, n))
    decode attention  = kv_token_s * resident_tokens / min(pp, B)       (KV read, bandwidth-bound)
    prefill attention = pair_s * query_tokens * key_tokens / pp          (FLOP-bound)
    remote            = remote_s + remote_seq_s * B   when some of the batch's KV is on another server

All times in seconds, sizes in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from infinite_llm.sim.models import ModelShape

CALIBRATIONS_DIR = Path(__file__).parent / "calibrations"
BUILTIN = {"cpu": "cpu_smollm2_135m.yaml", "a100": "a100_80gb.yaml", "h200": "h200.yaml"}
GIB = 1024**3


@dataclass(frozen=True)
class InstanceCost:
    """Step-cost coefficients of one compute instance (``tp * pp`` accelerators) and its home KV capacity."""

    tp: int
    pp: int
    fixed_s: float
    seq_s: float
    weights_s: float
    token_s: float
    kv_token_s: float
    pair_s: float
    remote_s: float
    remote_seq_s: float
    kv_capacity_tokens: int

    def dense_s(self, batch: int, num_tokens: int) -> float:
        """Dense layers of a step with ``batch`` sequences and ``num_tokens`` tokens (weights read once)."""
        spread = min(self.pp, num_tokens) if num_tokens > 0 else 1
        return self.fixed_s + self.seq_s * batch + max(self.weights_s, self.token_s * num_tokens / spread)

    def decode_attn_s(self, resident_tokens: float, batch: int) -> float:
        """Decode attention over ``resident_tokens`` of KV on this instance's accelerators; pipeline stages
        read in parallel only when there are microbatches for them (``min(pp, batch)``)."""
        return self.kv_token_s * resident_tokens / max(min(self.pp, batch), 1)

    def prefill_attn_s(self, pairs: float) -> float:
        """Causal attention of a prefill chunk: ``pairs`` = query tokens x key tokens (causal half counted)."""
        return self.pair_s * pairs / self.pp

    def remote_wait_s(self, batch: int) -> float:
        return self.remote_s + self.remote_seq_s * batch


@dataclass(frozen=True)
class Hardware:
    """One accelerator's figures (a ``hardware`` calibration). Bandwidths in bytes/s, FLOP/s, seconds."""

    memory_bytes: float
    hbm_bytes_per_s: float
    flops_per_s: float
    memory_utilization: float  # fraction of memory the serving engine may use (vLLM's gpu_memory_utilization)
    activation_reserve_bytes: float  # per accelerator, kept for activations and workspaces
    dense_bw_efficiency: float  # weight reads of the decode GEMVs, fraction of hbm_bytes_per_s
    attn_bw_efficiency: float  # paged decode attention's KV reads
    dense_flops_efficiency: float  # prefill GEMMs
    attn_flops_efficiency: float  # prefill attention
    host_step_s: float  # per step: scheduler, launches, sampling
    host_seq_s: float  # per sequence of the batch
    allreduce_s: float  # one tensor-parallel all-reduce of a decode step's activations (latency-bound)
    pipeline_hop_s: float  # one pipeline stage hand-off (across nodes)
    remote_layer_s: float  # one layer's round trip to a remote attention server (query out, partial back)


@dataclass(frozen=True)
class Calibration:
    """A loaded calibration file: ``kind`` ``hardware`` (``hardware`` set) or ``fitted`` (``model`` and
    ``coefficients`` set: ``fixed_s``, ``seq_s``, ``token_s``, ``pair_s``, ``kv_token_s``, ``remote_s``,
    ``remote_seq_s``)."""

    name: str
    kind: str
    source: str
    hardware: Hardware | None = None
    model: str = ""
    coefficients: dict | None = None
    measurements: dict | None = None

    def instance_cost(self, model: ModelShape, tp: int = 1, pp: int = 1, kv_memory_bytes: float | None = None):
        """The :class:`InstanceCost` of ``model`` on ``tp * pp`` accelerators.

        ``kv_memory_bytes``: KV memory of the instance's home (required for a ``fitted`` calibration, whose
        machine has no fixed memory; for ``hardware`` the default is what the accelerators leave after
        weights, activations and ``memory_utilization``).

        Raises:
            ValueError: the model does not fit, a fitted calibration used for another model or parallel
                shape, or no KV memory given where one is needed.
        """
        if self.kind == "fitted":
            return self._fitted_cost(model, tp, pp, kv_memory_bytes)
        return _roofline_cost(self.hardware, model, tp, pp, kv_memory_bytes)

    def _fitted_cost(self, model: ModelShape, tp: int, pp: int, kv_memory_bytes: float | None) -> InstanceCost:
        if model.name != self.model or (tp, pp) != (1, 1):
            raise ValueError(f"calibration {self.name!r} was fitted for {self.model} on one instance, not {model.name}")
        if kv_memory_bytes is None:
            raise ValueError(f"calibration {self.name!r} needs the instance's KV memory (kv_memory_bytes)")
        c = self.coefficients
        return InstanceCost(
            tp=1,
            pp=1,
            fixed_s=c["fixed_s"],
            seq_s=c["seq_s"],
            weights_s=0.0,
            token_s=c["token_s"],
            kv_token_s=c["kv_token_s"],
            pair_s=c["pair_s"],
            remote_s=c["remote_s"],
            remote_seq_s=c["remote_seq_s"],
            kv_capacity_tokens=int(kv_memory_bytes // model.kv_bytes_per_token),
        )


def _roofline_cost(hw: Hardware, model: ModelShape, tp: int, pp: int, kv_memory_bytes: float | None) -> InstanceCost:
    """Roofline coefficients: weights read at the dense bandwidth by ``tp`` accelerators of a stage, dense
    FLOPs on ``tp`` of them per microbatch, KV read and prefill attention on ``tp`` of them; a tensor-parallel
    decode step pays two all-reduces per layer, a pipeline one hop per stage."""
    n_acc = tp * pp
    if kv_memory_bytes is None:
        usable = n_acc * (hw.memory_bytes * hw.memory_utilization - hw.activation_reserve_bytes)
        kv_memory_bytes = usable - model.weight_bytes
    if kv_memory_bytes <= 0:
        raise ValueError(f"{model.name} does not fit on {n_acc} accelerators of {hw.memory_bytes / GIB:.0f} GiB")
    comm = (2 * model.num_layers * hw.allreduce_s if tp > 1 else 0.0) + (pp - 1) * hw.pipeline_hop_s
    return InstanceCost(
        tp=tp,
        pp=pp,
        fixed_s=hw.host_step_s + comm,
        seq_s=hw.host_seq_s,
        weights_s=model.weight_bytes / (tp * hw.hbm_bytes_per_s * hw.dense_bw_efficiency),  # every stage once
        token_s=model.dense_flops_per_token / (tp * hw.flops_per_s * hw.dense_flops_efficiency),
        kv_token_s=model.kv_bytes_per_token / (tp * hw.hbm_bytes_per_s * hw.attn_bw_efficiency),
        pair_s=model.attn_flops_per_pair / (tp * hw.flops_per_s * hw.attn_flops_efficiency),
        remote_s=model.num_layers * hw.remote_layer_s,
        remote_seq_s=0.0,
        kv_capacity_tokens=int(kv_memory_bytes // model.kv_bytes_per_token),
    )


def load_calibration(name_or_path: str) -> Calibration:
    """A built-in calibration (``cpu``, ``a100``, ``h200``) or a YAML file; ValueError if malformed."""
    path = CALIBRATIONS_DIR / BUILTIN[name_or_path] if name_or_path in BUILTIN else Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"calibration {name_or_path!r}: no such file; built-in: {', '.join(BUILTIN)}")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "hardware":
        names = {f.name for f in fields(Hardware)}
        given = data.get("hardware") or {}
        if set(given) != names:
            raise ValueError(f"calibration {path}: hardware needs exactly {sorted(names)}, got {sorted(given)}")
        hw = Hardware(**{k: float(v) for k, v in given.items()})
        return Calibration(name=data["name"], kind=kind, source=data["source"], hardware=hw)
    if kind == "fitted":
        coeff = {k: float(v) for k, v in data["coefficients"].items()}
        return Calibration(
            name=data["name"],
            kind=kind,
            source=data["source"],
            model=data["model"],
            coefficients=coeff,
            measurements=data.get("measurements"),
        )
    raise ValueError(f"calibration {path}: kind must be 'hardware' or 'fitted', got {kind!r}")


def fit_coefficients(measurements: dict) -> dict[str, float]:
    """Fit the ``fitted`` cost coefficients to engine measurements, least squares in relative error.

    ``measurements``:
        ``decode_steps``: ``[[batch, seconds per step], ...]`` (short contexts: attention negligible);
        ``prefill_steps``: ``[[prompt tokens, seconds], ...]``, each prompt prefilled in one step;
        ``kv_read_bytes_per_s`` and ``kv_bytes_per_token``: the paged attention's KV bandwidth;
        ``remote_steps``: ``[[batch, extra seconds per step], ...]`` of the mesh over the in-process engine.

    A decode step of ``B`` is ``fixed + (seq + token) * B``; a one-step prefill of ``n`` is
    ``fixed + seq + token * n + pair * n^2 / 2``; the remote term is ``remote + remote_seq * B`` (exact through
    two points). Returns the coefficients rounded to 4 significant digits.
    """
    import numpy as np

    rows = [[1.0, b, b, 0.0] for b, _ in measurements["decode_steps"]]
    rows += [[1.0, 1.0, n, n * n / 2.0] for n, _ in measurements["prefill_steps"]]
    y = np.array([s for _, s in measurements["decode_steps"]] + [s for _, s in measurements["prefill_steps"]])
    a = np.array(rows) / y[:, None]  # relative error: a 40 ms step weighs as much as a 7 s one
    fixed, seq, token, pair = np.linalg.lstsq(a, np.ones_like(y), rcond=None)[0]
    (b0, r0), (b1, r1) = measurements["remote_steps"][:2]
    remote_seq = (r1 - r0) / (b1 - b0)
    out = {
        "fixed_s": fixed,
        "seq_s": seq,
        "token_s": token,
        "pair_s": pair,
        "kv_token_s": measurements["kv_bytes_per_token"] / measurements["kv_read_bytes_per_s"],
        "remote_s": r0 - remote_seq * b0,
        "remote_seq_s": remote_seq,
    }
    return {k: float(f"{float(v):.4g}") for k, v in out.items()}
