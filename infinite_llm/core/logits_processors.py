"""Logits processors: penalties, logit bias and min_tokens, applied to the rows of the sequences that ask.

Order and meaning follow vLLM v1 (``vllm/v1/sample/ops/penalties.py``, ``logits_processor``) and OpenAI's
parameter reference:
- ``min_tokens``: while a sequence has fewer output tokens, its stop token ids (EOS unless ``ignore_eos``,
  and ``stop_token_ids``) get ``-inf``;
- ``logit_bias``: ``logits[t] += bias`` per listed token id;
- ``repetition_penalty`` ``r`` (CTRL, Keskar et al. 2019): every token seen in the prompt or the output has
  its logit divided by ``r`` when positive, multiplied by ``r`` when not;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI): over the output tokens only,
  ``logits[t] -= f * count[t] + p * (count[t] > 0)``.
Rows of sequences without any processor are not touched (nor copied), so they cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinite_llm.core.sampling import SamplingParams


@dataclass(frozen=True)
class SeqTokens:
    """What the processors of one sequence read: its prompt and output token ids so far, and the token
    ids that would end it (masked before ``min_tokens``)."""

    prompt: list[int]
    output: list[int]
    stop_ids: tuple[int, ...] = ()


def apply_processors(logits: torch.Tensor, params: list[SamplingParams], seqs: list[SeqTokens]) -> torch.Tensor:
    """``logits [num_seqs, vocab_size]`` fp32 with each row's processors applied; the input is unchanged
    (a copy is made only when some row has a processor)."""
    assert logits.shape[0] == len(params) == len(seqs)
    rows = [i for i, p in enumerate(params) if p.has_processors]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        out[i] = _process_row(out[i], params[i], seqs[i])
    return out


def _process_row(row: torch.Tensor, p: SamplingParams, seq: SeqTokens) -> torch.Tensor:
    """One sequence's ``row [vocab_size]`` after its processors, in vLLM's order."""
    vocab, device = row.shape[0], row.device
    if len(seq.output) < p.min_tokens and seq.stop_ids:
        row[torch.tensor(seq.stop_ids, dtype=torch.int64, device=device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device)
    output = torch.tensor(seq.output, dtype=torch.int64, device=device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(seq.prompt, dtype=torch.int64, device=device)] = True
        seen[output] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, penalized, row)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(output, minlength=vocab).to(row.dtype)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    return row
