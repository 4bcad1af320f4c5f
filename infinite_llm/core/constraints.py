"""Token constraints (structured output): which tokens a sequence may sample next, as a bitmask per row.

A constraint is a grammar matcher that the engine builds for a request (``engine/structured.py``, over
llguidance) and advances with every token the request samples. The sampler asks each constrained
sequence of a batch for its allowed-token bitmask and sets the logits of every other token to ``-inf``
after the logits processors and before sampling (vLLM v1's ``apply_grammar_bitmask``). Rows of
unconstrained sequences are neither read nor copied. Bitmask layout (llguidance's and xgrammar's): token
``t`` is allowed when bit ``t % 32`` of int32 word ``t // 32`` is set.
"""

from __future__ import annotations

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


def apply_constraints(logits: torch.Tensor, constraints: list[TokenConstraint | None]) -> torch.Tensor:
    """``logits [num_seqs, vocab_size]`` with every token a row's constraint forbids at ``-inf``.

    The input is returned as is when no row is constrained; else a new tensor made in one pass (the raw
    logits stay intact for logprobs). One bitmask is filled per constrained row on the host and moved to
    ``logits``' device once.
    """
    assert logits.shape[0] == len(constraints)
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bitmask = torch.empty(len(rows), bitmask_words(vocab), dtype=torch.int32)
    for j, i in enumerate(rows):
        constraints[i].fill_bitmask(bitmask[j])
    forbidden = ~unpack_bitmask(bitmask.to(logits.device), vocab)  # (len(rows), vocab)
    if len(rows) < logits.shape[0]:  # unconstrained rows forbid nothing
        every = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        every[torch.tensor(rows, dtype=torch.int64, device=logits.device)] = forbidden
        forbidden = every
    return logits.masked_fill(forbidden, float("-inf"))
