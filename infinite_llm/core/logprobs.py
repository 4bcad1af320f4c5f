"""Token log-probabilities: of sampled tokens (OpenAI ``logprobs``) and of prompt tokens (``echo``).

They are the log-softmax of the raw logits the sampler draws from, before temperature, penalties, biases or
a grammar mask, as vLLM reports by default (``logprobs_mode="raw_logprobs"``) and OpenAI documents. Each
position also names its ``num_top`` most likely tokens; like vLLM, the scored token is reported beside them
whether or not it is among them. Source: vLLM v1 ``Sampler.compute_logprobs`` / ``gather_logprobs``.

The types only (no torch, for the router, gateway and SDK); :func:`infinite_llm.core.sampler.token_logprobs`
computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # OpenAI's cap on ``top_logprobs`` (and on the completions API's ``logprobs``)


@dataclass(frozen=True)
class TokenLogprob:
    """``logprob`` (natural log) of ``token_id`` at one position; ``top``: the ``num_top`` most likely tokens
    there as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def prompt_targets(num_prompt: int, num_recorded: int, lo: int, hi: int) -> range:
    """Prompt token indices whose log-probability a step over positions ``[lo, hi)`` newly yields.

    The logits at position ``j`` score token ``j + 1``, so the step scores prompt tokens ``lo + 1 .. hi``
    that exist (``< num_prompt``) and were not recorded before (``> num_recorded``: a sequence recomputed
    after preemption scores nothing twice). Token 0 has no log-probability (nothing precedes it).
    """
    return range(max(lo + 1, num_recorded + 1), min(hi, num_prompt - 1) + 1)
