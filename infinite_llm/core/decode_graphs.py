"""CUDA-graph decode: the single-process engine's decode step, captured once per batch-size bucket.

At batch 1 a decode step is hundreds of small kernels; launched one by one from Python the GPU idles
between them (measured on an H200 with the 1B-shaped model: 11 ms of wall time per step, 1.6 ms of it GPU
work). A CUDA graph records the whole step, embedding to logits, on static buffers and replays it with one
launch. Each step only refills the buffers: input ids, positions and, per holder (in-process rManager), the
block tables, slot mapping and context lengths, packed in one buffer per bucket so that a step is one
host-to-device copy (on an H200 the 7 copies of a one-holder step took 0.2-0.36 ms of host time a step under
cProfile, when the GPU waited 0.38 ms a step for the host: ``benchmarks/RESULTS.md``). Source: nano-vllm
``ModelRunner.capture_cudagraph``, vLLM ``CUDAGraphRunner`` (buckets 1, 2, 4, then multiples of 8).

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

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
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


class _Field:
    """One static input of a bucket: a view of the bucket's device buffer and the same view of its host twin."""

    def __init__(self, tensor: torch.Tensor, host: np.ndarray) -> None:
        self.tensor = tensor
        self.np = host


class _HolderInputs(NamedTuple):
    """One holder's static step inputs in a bucket: ``[bucket, width]`` block tables, ``[bucket]`` the rest."""

    rmanager: RManager
    block_ids: _Field
    block_indices: _Field
    num_blocks: _Field
    context_lens: _Field
    slot_mapping: _Field

    @property
    def width(self) -> int:
        return self.block_ids.tensor.shape[1]

    def clear(self) -> None:
        """Every row is padding: no block, no context, no slot."""
        self.num_blocks.np[:] = 0
        self.context_lens.np[:] = 0
        self.slot_mapping.np[:] = -1


FIELD_ALIGN = 2  # int64 elements: every field starts 16-byte aligned, as Triton specializes kernels on it


def _aligned(n: int) -> int:
    return -(-n // FIELD_ALIGN) * FIELD_ALIGN


class _BucketInputs:
    """Every static input of one bucket of ``batch`` rows, packed in one int64 device buffer, so that a step
    is one host-to-device copy: input ids, positions, then per holder num_blocks, context lengths, slot
    mapping and the two ``[batch, width]`` block tables. On CUDA the host twin is pinned memory and the upload
    one asynchronous copy (the step's sampling syncs before the next step writes it again); on CPU the twin is
    the buffer itself. Each bucket has its own buffer (its graph reads fixed addresses), of about
    ``batch * (2 + holders * (3 + 2 * width)) * 8`` bytes (each field 16-byte aligned).
    """

    def __init__(self, batch: int, holders: Mapping[HolderId, RManager], widths: Mapping[HolderId, int], device):
        sizes = [batch, batch] + [
            n for h in holders for n in (batch, batch, batch, batch * widths[h], batch * widths[h])
        ]
        total = sum(_aligned(n) for n in sizes)
        self.buffer = torch.zeros(total, dtype=torch.int64, device=device)
        on_host = device.type == "cpu"
        self._host = None if on_host else torch.zeros(total, dtype=torch.int64, device="cpu", pin_memory=True)
        host = (self.buffer if on_host else self._host).numpy()
        offset = 0

        def take(*shape: int) -> _Field:
            nonlocal offset
            n = math.prod(shape)
            field = _Field(self.buffer[offset : offset + n].view(shape), host[offset : offset + n].reshape(shape))
            offset += _aligned(n)
            return field

        self.input_ids, self.positions = take(batch), take(batch)
        self.holders: dict[HolderId, _HolderInputs] = {}
        for h, rm in holders.items():
            num_blocks, context_lens, slot_mapping = take(batch), take(batch), take(batch)
            block_ids, block_indices = take(batch, widths[h]), take(batch, widths[h])
            self.holders[h] = _HolderInputs(rm, block_ids, block_indices, num_blocks, context_lens, slot_mapping)
            self.holders[h].clear()

    def upload(self) -> None:
        """One copy of the whole bucket to the device (nothing on CPU)."""
        if self._host is not None:
            self.buffer.copy_(self._host, non_blocking=True)


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
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)  # one query each
        max_blocks = -(-max_model_len // dist.block_size)
        widths = {h: min(rm.pool.num_blocks, max_blocks) for h, rm in holders.items()}
        self.holders = dict(holders)
        self.inputs = {b: _BucketInputs(b, holders, widths, device) for b in self.buckets}
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
        """Write the step into the bucket's buffer (rows ``>= len(steps)`` padding); returns the widest
        block-table row. Host work only (lists into numpy), then one upload: no kernel, no host sync.
        """
        n = len(steps)
        plans = self.dist.holder_plans(steps)
        built = {h: self.holders[h].plan_rows(seqs) for h, seqs in plans.items()}  # checks, then writes
        row_of = {s.seq_id: i for i, s in enumerate(steps)}
        inputs = self.inputs[batch]
        inputs.input_ids.np[:n] = input_ids
        inputs.positions.np[:n] = [s.num_computed_tokens for s in steps]
        inputs.input_ids.np[n:] = 0
        inputs.positions.np[n:] = 0
        widest = 1
        for h, buf in inputs.holders.items():
            buf.clear()
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
        inputs.upload()
        return widest

    def _forward(self, batch: int, width: int | None) -> torch.Tensor:
        """The model over the bucket's buffer; block tables cut to ``width`` columns (``None``: each
        holder's full width, as captured)."""
        inputs = self.inputs[batch]
        parts = []
        for buf in inputs.holders.values():
            w = buf.width if width is None else min(width, buf.width)
            meta = PartialAttentionMetadata(
                query_start_loc=self.query_start_loc[: batch + 1],
                query_positions=inputs.positions.tensor,
                block_ids=buf.block_ids.tensor[:, :w],
                block_indices=buf.block_indices.tensor[:, :w],
                num_blocks=buf.num_blocks.tensor,
                context_lens=buf.context_lens.tensor,
            )
            parts.append((buf.rmanager, meta, buf.slot_mapping.tensor))
        attention = _StaticAttention(parts, self.merge)
        return self.model(inputs.input_ids.tensor, inputs.positions.tensor, attention, self.logits_indices[:batch])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Record one graph per bucket, largest first, sharing one memory pool (later graphs reuse it)."""
        with torch.cuda.device(self.device):  # cuda:N: capture on that device's streams
            self._capture_on_device()

    def _capture_on_device(self) -> None:
        pool = None
        for batch in reversed(self.buckets):
            self.inputs[batch].upload()  # every row padding (as built)
            self._forward(batch, None)  # warm-up: compiles the Triton kernels of these shapes, sizes cuBLAS
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[batch] = self._forward(batch, None)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
