"""Token constraints (structured output): which tokens a sequence may sample next, as a bitmask per row.

A constraint is a grammar matcher that the engine builds for a request (``engine/structured.py``, over
llguidance) and advances with every token the request samples. The sampler asks each constrained
sequence of a batch for its allowed-token bitmask and sets the logits of every other token to ``-inf``
after the logits processors and before sampling (vLLM v1's ``apply_grammar_bitmask``). The masks depend
only on the tokens accepted so far, so they can be computed while the model computes the step's logits
(:class:`MaskPrefetch`; llguidance's docs suggest the same). Rows of unconstrained sequences are neither
read nor copied. Bitmask layout (llguidance's and xgrammar's): token
``t`` is allowed when bit ``t % 32`` of int32 word ``t // 32`` is set.
"""

from __future__ import annotations

from collections.abc import Callable
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


# Bit b of byte v, for every byte value: unpacking a bitmask is one lookup per byte of it.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # (256, 8)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bitmask [num_rows, ceil(vocab_size / 32)]`` int32 -> ``[num_rows, vocab_size]`` bool (True: allowed).

    Little-endian words (x86, ARM, CUDA): bit ``b`` of word ``w`` is bit ``b % 8`` of byte ``4 w + b // 8``,
    so token ``t`` is bit ``t % 8`` of byte ``t // 8``.
    """
    num_bytes = bitmask.contiguous().view(torch.uint8)  # (num_rows, 4 * words)
    bits = _BYTE_BITS.to(bitmask.device)[num_bytes.long()]  # (num_rows, 4 * words, 8)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def forbidden_tokens(constraints: list[TokenConstraint | None], vocab_size: int) -> torch.Tensor | None:
    """``[num_seqs, vocab_size]`` bool on the CPU, True where a row's constraint forbids the token; None when no
    row is constrained (rows of unconstrained sequences forbid nothing).

    One bitmask is filled per constrained row, then all are unpacked at once. Reads each constraint's state
    and changes none, so it may run on another thread while the model computes the step's logits
    (:class:`MaskPrefetch`), as long as nobody advances the constraints meanwhile.
    """
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), bitmask_words(vocab_size), dtype=torch.int32)
    for j, i in enumerate(rows):
        constraints[i].fill_bitmask(bitmask[j])
    forbidden = ~unpack_bitmask(bitmask, vocab_size)  # (len(rows), vocab_size)
    if len(rows) == len(constraints):
        return forbidden
    every = torch.zeros(len(constraints), vocab_size, dtype=torch.bool)
    every[torch.tensor(rows, dtype=torch.int64)] = forbidden
    return every


def apply_forbidden(logits: torch.Tensor, forbidden: torch.Tensor | None) -> torch.Tensor:
    """``logits [num_seqs, vocab_size]`` with the ``forbidden [num_seqs, vocab_size]`` bool tokens at ``-inf``:
    a new tensor (the raw logits stay intact for logprobs), or ``logits`` itself when ``forbidden`` is None."""
    if forbidden is None:
        return logits
    assert forbidden.shape == logits.shape, (forbidden.shape, logits.shape)
    return logits.masked_fill(forbidden.to(logits.device, non_blocking=True), float("-inf"))


class MaskPrefetch(Protocol):
    """Starts computing a step's forbidden tokens before the model runs, so the grammar work can overlap
    the forward (the engine's implementation uses a worker thread: ``engine/structured.py``)."""

    def start(self, constraints: list[TokenConstraint | None], vocab_size: int) -> Callable[[], torch.Tensor | None]:
        """Begin :func:`forbidden_tokens` of ``constraints``; the returned callable waits for its result.
        The caller must not advance the constraints before calling it."""


class ComputeOnWait:
    """The plain :class:`MaskPrefetch`: computes the masks when they are asked for, on the calling thread."""

    def start(self, constraints: list[TokenConstraint | None], vocab_size: int) -> Callable[[], torch.Tensor | None]:
        return lambda: forbidden_tokens(constraints, vocab_size)
