"""CUDA-graph decode: the single-process engine's decode step, captured once per batch-size bucket.

At batch 1 a decode step is hundreds of small kernels; launched one by one from Python the GPU idles
between them (measured on an H200 with the 1B-shaped model: 11 ms of wall time per step, 1.6 ms of it GPU
work). A CUDA graph records the whole step, embedding to logits, on static buffers and replays it with one
launch. Each step only refills the buffers: input ids, positions and, per holder (in-process rManager), the
block tables, slot mapping and context lengths. Source: nano-vllm ``ModelRunner.capture_cudagraph``, vLLM
``CUDAGraphRunner`` (buckets 1, 2, 4, then multiples of 8).

What a graph bakes in, and how the static path keeps a replay valid:

- **Shapes.** A batch of ``n`` sequences runs in the smallest bucket ``b >= n``; the ``b - n`` padding rows
  have token 0 at position 0, ``num_blocks = 0`` (an empty part: out 0, lse -inf) and slot -1 (no K/V
  written; ``write_kv`` skips negative slots).
- **Holders.** Every holder sees every query of the bucket; a sequence that keeps nothing on a holder is an
  empty part there, and the new token's K/V is written only by the holder whose slot-mapping row is >= 0.
  The per-holder partials are merged exactly, as the eager path does.
- **Block tables** are ``[bucket, width]`` with ``width`` the most rBlocks a sequence can keep on the holder
  (its pool, or the model's maximum length). The kernel's KV splits are sized for that width, and each
  sequence spreads its own blocks over them (``kernels/paged_attention.py``).
- **No Python state is read at replay**: the plans are built (and checked) by :meth:`RManager.plan_step`
  before the buffers are filled, and the graph calls :meth:`RManager.attend_planned`.

Prefill, mixed steps and batches above the largest bucket run eagerly (:class:`~infinite_llm.core.runner.ModelRunner`).
Without capture (``capture=False``: CPU, or a test) the same buffers run eagerly with the block tables cut to
the step's widest row, so CI exercises the bookkeeping that the graphs replay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from infinite_llm.core.attention import PartialAttentionMetadata, merge_partials
from infinite_llm.core.dist_attention import DistAttention, HolderId, MergeFn
from infinite_llm.core.model import LlamaForCausalLM
from infinite_llm.core.rmanager import RManager, SeqStep


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8 below ``max_batch``, and ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


class _Staged:
    """A static int64 device buffer and its host twin, written through numpy and uploaded once per step.

    On CUDA the host twin is pinned memory and the upload one asynchronous copy (the step's sampling syncs
    before the next step writes it again); on CPU the twin is the buffer itself.
    """

    def __init__(self, shape: tuple[int, ...], fill: int, device: torch.device) -> None:
        self.tensor = torch.full(shape, fill, dtype=torch.int64, device=device)
        on_host = device.type == "cpu"
        host = self.tensor if on_host else torch.full(shape, fill, dtype=torch.int64, device="cpu", pin_memory=True)
        self._host = None if on_host else host
        self.np = host.numpy()

    def upload(self, rows: int) -> None:
        """Copy rows ``[:rows]`` to the device (nothing on CPU)."""
        if self._host is not None:
            self.tensor[:rows].copy_(self._host[:rows], non_blocking=True)


@dataclass(frozen=True)
class _HolderBuffers:
    """One holder's static step inputs: ``[max_batch, width]`` block tables, ``[max_batch]`` the rest."""

    rmanager: RManager
    block_ids: _Staged
    block_indices: _Staged
    num_blocks: _Staged
    context_lens: _Staged
    slot_mapping: _Staged

    @property
    def width(self) -> int:
        return self.block_ids.tensor.shape[1]

    def clear(self, batch: int) -> None:
        """Every row of a bucket of ``batch`` is padding: no block, no context, no slot."""
        self.num_blocks.np[:batch] = 0
        self.context_lens.np[:batch] = 0
        self.slot_mapping.np[:batch] = -1

    def upload(self, batch: int) -> None:
        for staged in (self.block_ids, self.block_indices, self.num_blocks, self.context_lens, self.slot_mapping):
            staged.upload(batch)


class _StaticAttention:
    """The ``AttentionFn`` of a static step: every holder over the whole bucket, then the exact merge."""

    def __init__(self, parts: list[tuple[RManager, PartialAttentionMetadata, torch.Tensor]], merge: MergeFn) -> None:
        self.parts = parts
        self.merge = merge

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [bucket, H, D]``, ``k, v [bucket, Hkv, D]`` -> ``[bucket, H, D]``."""
        partials = [rm.attend_planned(layer, meta, slots, q, k, v, max_query_len=1) for rm, meta, slots in self.parts]
        if len(partials) == 1:
            return partials[0][0]
        out, _ = self.merge(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
        return out


class DecodeGraphs:
    """Decode steps of up to ``max_batch`` sequences through static buffers, replayed as CUDA graphs.

    Args:
        model: the dense layers (on the device of the holders).
        dist: the engine's DistAttention (block tables, which holder serves which sequence).
        holders: its in-process rManagers, by holder id.
        max_batch: the largest captured bucket (batches above it run eagerly).
        max_model_len: tokens a sequence can reach; bounds the block-table width with each holder's pool.
        capture: record CUDA graphs (needs every holder on one CUDA device); ``False`` runs the same
            buffers eagerly.
        merge_fn: the exact merge of the holders' partials (Triton on CUDA through the kernels dispatcher).

    Raises:
        ValueError: ``capture`` with tensors off CUDA, or holders on different devices.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        dist: DistAttention,
        holders: Mapping[HolderId, RManager],
        max_batch: int,
        max_model_len: int,
        capture: bool,
        merge_fn: MergeFn = merge_partials,
    ) -> None:
        self.model = model
        self.dist = dist
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.merge = merge_fn
        devices = {rm.device for rm in holders.values()}
        if len(devices) != 1:
            raise ValueError(f"holders are on several devices: {sorted(map(str, devices))}")
        (self.device,) = devices
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA tensors; the KV is on {self.device}")
        device = self.device
        self.input_ids = _Staged((max_batch,), 0, device)
        self.positions = _Staged((max_batch,), 0, device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)  # one query each
        max_blocks = -(-max_model_len // dist.block_size)
        self.holders: dict[HolderId, _HolderBuffers] = {}
        for h, rm in holders.items():
            width = min(rm.pool.num_blocks, max_blocks)
            self.holders[h] = _HolderBuffers(
                rm,
                _Staged((max_batch, width), 0, device),
                _Staged((max_batch, width), 0, device),
                _Staged((max_batch,), 0, device),
                _Staged((max_batch,), 0, device),
                _Staged((max_batch,), -1, device),
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output buffer [bucket, vocab] fp32
        self.num_replays = 0
        self.num_eager = 0
        if capture:
            self._capture()

    def fits(self, steps: list[SeqStep]) -> bool:
        """A decode step this path runs: one new token per sequence, at most ``max_batch`` sequences."""
        return 0 < len(steps) <= self.max_batch and all(s.num_new == 1 for s in steps)

    def bucket(self, n: int) -> int:
        """The smallest captured batch size ``>= n``."""
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def run(self, steps: list[SeqStep], input_ids: list[int]) -> torch.Tensor:
        """One decode step: ``[len(steps), vocab]`` fp32 logits (a view of the graph's output buffer: read
        it before the next step).

        Raises :class:`~infinite_llm.core.errors.InvalidRequest` / ``NotFound`` from planning (nothing ran).
        """
        if not self.fits(steps) or len(input_ids) != len(steps):
            raise ValueError(f"not a decode step of at most {self.max_batch} sequences")
        n = len(steps)
        batch = self.bucket(n)
        width = self._fill(steps, input_ids, batch)
        graph = self.graphs.get(batch)
        if graph is None:
            self.num_eager += 1
            return self._forward(batch, width)[:n]
        with torch.cuda.device(self.device):  # the graph's device, whatever the current one is
            graph.replay()
        self.num_replays += 1
        return self._logits[batch][:n]

    def _fill(self, steps: list[SeqStep], input_ids: list[int], batch: int) -> int:
        """Write the step into the buffers (rows ``>= len(steps)`` padding); returns the widest block-table row.

        Host work only (lists into numpy), then one upload per buffer: no kernel, no host sync.
        """
        n = len(steps)
        plans = self.dist.holder_plans(steps)
        built = {h: self.holders[h].rmanager.plan_rows(seqs) for h, seqs in plans.items()}  # checks, then writes
        row_of = {s.seq_id: i for i, s in enumerate(steps)}
        self.input_ids.np[:n] = input_ids
        self.positions.np[:n] = [s.num_computed_tokens for s in steps]
        self.input_ids.np[n:batch] = 0
        self.positions.np[n:batch] = 0
        self.input_ids.upload(batch)
        self.positions.upload(batch)
        widest = 1
        for h, buf in self.holders.items():
            buf.clear(batch)
            plan = built.get(h)
            if plan is not None:
                for s, ids, idx, slots, ctx in zip(
                    plans[h], plan.block_ids, plan.block_indices, plan.slots, plan.context_lens, strict=True
                ):
                    r, k = row_of[s.seq_id], len(ids)
                    widest = max(widest, k)
                    buf.num_blocks.np[r] = k
                    buf.context_lens.np[r] = ctx
                    buf.block_ids.np[r, :k] = ids
                    buf.block_indices.np[r, :k] = idx
                    if slots:  # decode: one new token, stored on exactly one holder
                        (buf.slot_mapping.np[r],) = slots
            buf.upload(batch)
        return widest

    def _forward(self, batch: int, width: int | None) -> torch.Tensor:
        """The model over the first ``batch`` rows of the buffers; block tables cut to ``width`` columns
        (``None``: each holder's full width, as captured)."""
        parts = []
        for buf in self.holders.values():
            w = buf.width if width is None else min(width, buf.width)
            meta = PartialAttentionMetadata(
                query_start_loc=self.query_start_loc[: batch + 1],
                query_positions=self.positions.tensor[:batch],
                block_ids=buf.block_ids.tensor[:batch, :w],
                block_indices=buf.block_indices.tensor[:batch, :w],
                num_blocks=buf.num_blocks.tensor[:batch],
                context_lens=buf.context_lens.tensor[:batch],
            )
            parts.append((buf.rmanager, meta, buf.slot_mapping.tensor[:batch]))
        attention = _StaticAttention(parts, self.merge)
        ids, positions = self.input_ids.tensor[:batch], self.positions.tensor[:batch]
        return self.model(ids, positions, attention, self.logits_indices[:batch])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per bucket, largest first, sharing one memory pool (later graphs reuse it)."""
        with torch.cuda.device(self.device):  # cuda:N: capture on that device's streams
            self._capture_on_device()

    def _capture_on_device(self) -> None:
        pool = None
        for batch in reversed(self.buckets):
            for staged in (self.input_ids, self.positions):
                staged.np[:batch] = 0
                staged.upload(batch)
            for buf in self.holders.values():
                buf.clear(batch)
                buf.upload(batch)
            self._forward(batch, None)  # warm-up: compiles the Triton kernels of these shapes, sizes cuBLAS
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[batch] = self._forward(batch, None)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
