"""Token constraints (structured output): which tokens a sequence may sample next, as a bitmask per row.

A constraint is a grammar matcher that the engine builds for a request (``engine/structured.py``, over
llguidance) and advances with every token the request samples. The sampler asks each constrained
sequence of a batch for its allowed-token bitmask and sets the logits of every other token to ``-inf``
after the logits processors and before sampling (vLLM v1's ``apply_grammar_bitmask``). The masks depend
only on the tokens accepted so far, so they can be computed while the model computes the step's logits
(:class:`MaskPrefetch`; llguidance's docs suggest the same). Only constrained rows get a bitmask; unconstrained
rows keep their logits. Bitmask layout (llguidance's and xgrammar's): token ``t`` is allowed when bit ``t % 32``
of int32 word ``t // 32`` is set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """One sequence's grammar state."""

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out [ceil(vocab_size / 32)]`` int32 (CPU, contiguous)."""

    def accept(self, token_id: int) -> None:
        """Advance past the sampled ``token_id`` (one the last bitmask allowed)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class StepMasks:
    """The allowed-token bitmasks of a step's constrained sequences: ``rows`` (their indices in the step's
    sampling order, ascending) and ``bitmask [len(rows), ceil(vocab_size / 32)]`` int32 on the CPU."""

    rows: list[int]
    bitmask: torch.Tensor


def fill_bitmasks(constraints: list[TokenConstraint | None], vocab_size: int) -> StepMasks | None:
    """The bitmask of every constrained row of ``constraints``; None when no row is constrained.

    Only the packed bitmasks are made here (4 bytes per 32 tokens); they are expanded to the vocabulary on
    the logits' device when applied. Reads each constraint's state and changes none, so it may run on another
    thread while the model computes the step's logits (:class:`MaskPrefetch`), as long as nobody advances
    the constraints meanwhile.
    """
    masks = unfilled_masks(constraints, vocab_size)
    if masks is not None:
        for j, i in enumerate(masks.rows):
            constraints[i].fill_bitmask(masks.bitmask[j])
    return masks


def unfilled_masks(constraints: list[TokenConstraint | None], vocab_size: int) -> StepMasks | None:
    """The constrained rows of ``constraints`` with an uninitialised bitmask for them, for a filler to write;
    None when no row is constrained."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    return StepMasks(rows, torch.empty(len(rows), bitmask_words(vocab_size), dtype=torch.int32))


# Row v: the additive mask of byte value v's 8 tokens, 0 where bit b of v is set (allowed), -inf where not.
_BYTE_BIAS = torch.zeros(256, 8).masked_fill(((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0, -math.inf)
_byte_bias_on: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``bitmask [num_rows, ceil(vocab_size / 32)]`` int32 -> ``[num_rows, vocab_size]`` ``dtype`` on the
    bitmask's device: 0 where the token is allowed, ``-inf`` where it is not.

    One table row per byte of the bitmask (an ``index_select``, then adding it to the logits: on CPU about
    10x faster than expanding to bool and ``masked_fill``, which torch does not vectorise). Little-endian
    words (x86, ARM, CUDA): bit ``b`` of word ``w`` is bit ``b % 8`` of byte ``4 w + b // 8``, so token ``t``
    is bit ``t % 8`` of byte ``t // 8``.
    """
    key = (bitmask.device, dtype)
    table = _byte_bias_on.get(key)
    if table is None:
        table = _byte_bias_on.setdefault(key, _BYTE_BIAS.to(bitmask.device, dtype))
    num_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1)  # (num_rows * 4 * words)
    bias = table.index_select(0, num_bytes.long())  # (num_rows * 4 * words, 8)
    return bias.view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmasks(logits: torch.Tensor, masks: StepMasks | None) -> torch.Tensor:
    """``logits [num_seqs, vocab_size]`` with the tokens that ``masks`` forbids at ``-inf``: a new tensor (the raw
    logits stay intact for logprobs), or ``logits`` itself when ``masks`` is None. Rows not in ``masks.rows``
    keep their values. Logits are finite or ``-inf`` (an allowed ``-inf`` stays ``-inf``)."""
    if masks is None:
        return logits
    num_seqs, vocab_size = logits.shape
    bitmask = masks.bitmask.to(logits.device, non_blocking=True)
    bias = bitmask_bias(bitmask, vocab_size, logits.dtype)  # (len(rows), vocab_size)
    if len(masks.rows) == num_seqs:
        return logits + bias
    rows = torch.tensor(masks.rows, dtype=torch.int64, device=logits.device)
    return logits.index_add(0, rows, bias)


class MaskPrefetch(Protocol):
    """Starts computing a step's forbidden tokens before the model runs, so the grammar work can overlap
    the forward (the engine's implementation uses a worker thread: ``engine/structured.py``)."""

    def start(self, constraints: list[TokenConstraint | None], vocab_size: int) -> Callable[[], StepMasks | None]:
        """Begin :func:`fill_bitmasks` of ``constraints``; the returned callable waits for its result.
        The caller must not advance the constraints before calling it."""


class ComputeOnWait:
    """The plain :class:`MaskPrefetch`: computes the masks when they are asked for, on the calling thread."""

    def start(self, constraints: list[TokenConstraint | None], vocab_size: int) -> Callable[[], StepMasks | None]:
        return lambda: fill_bitmasks(constraints, vocab_size)
