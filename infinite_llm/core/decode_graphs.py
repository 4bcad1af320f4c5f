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
from infinite_llm.core.dist_attention import DistAttention, HolderId, HolderRows, MergeFn
from infinite_llm.core.model import LlamaForCausalLM
from infinite_llm.core.rmanager import RManager, SeqStep


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8 below ``max_batch``, and ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


@dataclass(frozen=True)
class _HolderBuffers:
    """One holder's static step inputs: ``[max_batch, width]`` block tables, ``[max_batch]`` the rest
    (int64, on the holder's device)."""

    rmanager: RManager
    block_ids: torch.Tensor
    block_indices: torch.Tensor
    num_blocks: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def width(self) -> int:
        return self.block_ids.shape[1]

    def clear(self, batch: int) -> None:
        """Every row of a bucket of ``batch`` is padding: no block, no context, no slot."""
        self.num_blocks[:batch].zero_()
        self.context_lens[:batch].zero_()
        self.slot_mapping[:batch].fill_(-1)


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
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.logits_indices = torch.arange(max_batch, **i64)
        self.query_start_loc = torch.arange(max_batch + 1, **i64)  # one query per sequence
        max_blocks = -(-max_model_len // dist.block_size)
        self.holders: dict[HolderId, _HolderBuffers] = {}
        for h, rm in holders.items():
            width = min(rm.pool.num_blocks, max_blocks)
            self.holders[h] = _HolderBuffers(
                rm,
                torch.zeros(max_batch, width, **i64),
                torch.zeros(max_batch, width, **i64),
                torch.zeros(max_batch, **i64),
                torch.zeros(max_batch, **i64),
                torch.full((max_batch,), -1, **i64),
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
        graph.replay()
        self.num_replays += 1
        return self._logits[batch][:n]

    def _fill(self, steps: list[SeqStep], input_ids: list[int], batch: int) -> int:
        """Write the step into the buffers (rows ``>= len(steps)`` padding); returns the widest block-table row."""
        n = len(steps)
        plans, rows = self.dist.split_step(steps)
        built = {h: self.holders[h].rmanager.plan_step(seqs) for h, seqs in plans.items()}  # checks, before writes
        self.input_ids[:n].copy_(torch.tensor(input_ids, dtype=torch.int64, device=self.device))
        positions = [s.num_computed_tokens for s in steps]
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int64, device=self.device))
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        widest = 1
        for h, buf in self.holders.items():
            buf.clear(batch)
            plan = built.get(h)
            if plan is None:
                continue
            r: HolderRows = rows[h]
            q = slice(0, n) if r.query_rows is None else r.query_rows
            w = plan.meta.block_ids.shape[1]
            widest = max(widest, w)
            buf.num_blocks[q] = plan.meta.num_blocks
            buf.context_lens[q] = plan.meta.context_lens
            buf.block_ids[q, :w] = plan.meta.block_ids
            buf.block_indices[q, :w] = plan.meta.block_indices
            buf.slot_mapping[slice(0, n) if r.new_rows is None else r.new_rows] = plan.slot_mapping
        return widest

    def _forward(self, batch: int, width: int | None) -> torch.Tensor:
        """The model over the first ``batch`` rows of the buffers; block tables cut to ``width`` columns
        (``None``: each holder's full width, as captured)."""
        parts = []
        for buf in self.holders.values():
            w = buf.width if width is None else min(width, buf.width)
            meta = PartialAttentionMetadata(
                query_start_loc=self.query_start_loc[: batch + 1],
                query_positions=self.positions[:batch],
                block_ids=buf.block_ids[:batch, :w],
                block_indices=buf.block_indices[:batch, :w],
                num_blocks=buf.num_blocks[:batch],
                context_lens=buf.context_lens[:batch],
            )
            parts.append((buf.rmanager, meta, buf.slot_mapping[:batch]))
        attention = _StaticAttention(parts, self.merge)
        return self.model(self.input_ids[:batch], self.positions[:batch], attention, self.logits_indices[:batch])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per bucket, largest first, sharing one memory pool (later graphs reuse it)."""
        pool = None
        for batch in reversed(self.buckets):
            self.input_ids[:batch].zero_()
            self.positions[:batch].zero_()
            for buf in self.holders.values():
                buf.clear(batch)
            self._forward(batch, None)  # warm-up: compiles the Triton kernels of these shapes, sizes cuBLAS
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[batch] = self._forward(batch, None)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
