"""The sampler: picks each sequence's next token from its logits, and the log-probabilities reported.

Greedy, temperature, top-k, top-p, reproducible with a seed. Reproducibility rule: the random draw for
output token ``i`` of a request uses a generator seeded from ``(seed, i)`` only, so a request gives the same
tokens alone or in any batch, and after preemption by recompute (vLLM's per-request generator gives the first
property; deriving from the index gives the second). Log-probabilities: :mod:`infinite_llm.core.logprobs`.
Source: vLLM v1 ``v1/sample/sampler.py``.
"""

from __future__ import annotations

import torch

from infinite_llm.core.logprobs import TokenLogprob
from infinite_llm.core.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) pairs over 64 bits


def _generator(seed: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * _SEED_MIX + index) % (1 << 63))
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    """Pick one token id from ``logits [vocab_size]`` fp32 for output position ``output_index``."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    assert params.seed is not None
    # The generator is a CPU one, so the draw is made on the CPU: a seed gives the same tokens on every device.
    return int(torch.multinomial(probs.cpu(), 1, generator=_generator(params.seed, output_index)))


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """Sample the next token of each sequence: ``logits [num_seqs, vocab_size]`` fp32 -> ``num_seqs`` ids."""
    assert logits.shape[0] == len(params) == len(output_indices)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:
        # all rows greedy (the common batch): no index tensor to upload and gather before the argmax
        rows = logits if len(greedy_rows) == len(params) else logits[greedy_rows]
        ids = torch.argmax(rows, dim=-1).tolist()
        for row, tok in zip(greedy_rows, ids, strict=True):
            out[row] = tok
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, output_indices[i])
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Log-probabilities of ``token_ids`` under ``logits``, one position per row.

    Args:
        logits: ``[num_positions, vocab_size]`` raw logits (any float dtype; computed in fp32).
        token_ids: ``num_positions`` scored token ids (sampled, or the prompt's next token).
        num_top: ``num_positions`` counts in ``[0, MAX_LOGPROBS]`` of top alternatives per position.

    Returns:
        One :class:`TokenLogprob` per row, on the host.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids) == len(num_top), "one row per position"
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # (num_positions, vocab)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    k = max(num_top)
    top_lp, top_ids = lp.topk(k, dim=-1, sorted=True) if k else (lp[:, :0], lp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(top_ids[i][: num_top[i]], top_lp[i][: num_top[i]], strict=True)))
        for i, (t, c) in enumerate(zip(token_ids, chosen, strict=True))
    ]
