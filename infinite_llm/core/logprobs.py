"""Token log-probabilities: of sampled tokens (OpenAI ``logprobs``) and of prompt tokens (``echo``).

They are the log-softmax of the raw logits the sampler draws from, before temperature, penalties, biases or
a grammar mask, as vLLM reports by default (``logprobs_mode="raw_logprobs"``) and OpenAI documents. Each
position also names its ``num_top`` most likely tokens; like vLLM, the scored token is reported beside them
whether or not it is among them. Source: vLLM v1 ``Sampler.compute_logprobs`` / ``gather_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # OpenAI's cap on ``top_logprobs`` (and on the completions API's ``logprobs``)


@dataclass(frozen=True)
class TokenLogprob:
    """``logprob`` (natural log) of ``token_id`` at one position; ``top``: the ``num_top`` most likely tokens
    there as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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


def prompt_targets(num_prompt: int, num_recorded: int, lo: int, hi: int) -> range:
    """Prompt token indices whose log-probability a step over positions ``[lo, hi)`` newly yields.

    The logits at position ``j`` score token ``j + 1``, so the step scores prompt tokens ``lo + 1 .. hi``
    that exist (``< num_prompt``) and were not recorded before (``> num_recorded``: a sequence recomputed
    after preemption scores nothing twice). Token 0 has no log-probability (nothing precedes it).
    """
    return range(max(lo + 1, num_recorded + 1), min(hi, num_prompt - 1) + 1)
