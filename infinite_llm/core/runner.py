"""Model runner: turns a scheduler step into flat model inputs, runs the dense layers, samples.

The runner never sees the scheduler's queues (nano-vllm's split): it receives the scheduled sequences and
an attention backend that knows where KV lives (a ``DistAttention`` over local rManagers here, over remote
attention servers in the mesh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infinite_llm.core.constraints import ComputeOnWait, MaskPrefetch, apply_bitmasks
from infinite_llm.core.decode_graphs import DecodeGraphs
from infinite_llm.core.dist_attention import StepAttention
from infinite_llm.core.logits_processors import SeqTokens, apply_processors
from infinite_llm.core.logprobs import TokenLogprob, prompt_targets
from infinite_llm.core.model import AttentionFn, LlamaForCausalLM
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.core.sampler import sample, token_logprobs
from infinite_llm.core.scheduler import ScheduledSeq

PrepareFn = Callable[[list[SeqStep], int], StepAttention]  # (step's sequences, num_heads) -> attention
Interrupt = Callable[[], bool]  # asked before each layer's attention: True cuts the step there


class StepInterrupted(Exception):
    """A step cut between two layers because its ``interrupt`` check asked for it (a request of the step
    was aborted). Nothing of the step was recorded: the scheduler plans the same step again without the
    aborted request, and the K/V the cut layers stored is written again, to the same slots, by that step.
    """


class ModelRunner:
    """Runs ``model`` over a step with attention from ``prepare_attention``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        prepare_attention: PrepareFn,
        device: torch.device | str = "cpu",
        decode_graphs: DecodeGraphs | None = None,
        mask_prefetch: MaskPrefetch | None = None,
    ):
        """``decode_graphs``: where decode steps that fit go (CUDA graphs, or their static buffers run
        eagerly); every other step runs eagerly through ``prepare_attention``. ``mask_prefetch``: how the
        constrained sequences' token masks are computed (default: after the forward, on this thread)."""
        self.model = model
        self.prepare_attention = prepare_attention
        self.device = torch.device(device)
        self.decode_graphs = decode_graphs
        self.mask_prefetch: MaskPrefetch = mask_prefetch if mask_prefetch is not None else ComputeOnWait()

    def run(self, scheduled: list[ScheduledSeq], interrupt: Interrupt | None = None) -> StepResult:
        """One step: the sampled next token of every sequence whose step ends its known tokens (none for a
        prompt scored with ``max_tokens == 0``), and the log-probabilities the sequences' params ask for.

        Inputs are flattened: ``input_ids, positions [num_tokens]`` int64, sequences in ``scheduled`` order.
        Logits rows: the prompt positions to score (``prompt_logprobs``: every prompt position of a prefill
        chunk, so a long chunk costs ``[chunk_tokens, vocab_size]`` fp32 of logits) first, then one per
        sampling sequence.

        ``interrupt`` is asked before each layer's attention (steps through ``prepare_attention`` only; a
        replayed CUDA graph runs whole). Raises :class:`StepInterrupted` when it answers True: the step's
        attention is closed as failed and nothing is sampled.
        """
        ids: list[int] = []
        positions: list[int] = []
        prompt_rows: list[int] = []
        scored: list[tuple[ScheduledSeq, range]] = []  # (sequence, prompt tokens it scores this step)
        sample_rows: list[int] = []
        sampling: list[ScheduledSeq] = []
        for s in scheduled:
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + s.num_new
            base = len(ids)
            ids.extend(s.seq.all_token_ids[lo:hi])
            positions.extend(range(lo, hi))
            if s.seq.params.prompt_logprobs is not None:
                targets = prompt_targets(len(s.seq.prompt_token_ids), len(s.seq.prompt_logprobs), lo, hi)
                prompt_rows.extend(base + t - 1 - lo for t in targets)
                scored.append((s, targets))
            if s.samples and s.seq.params.max_tokens > 0:
                sample_rows.append(len(ids) - 1)
                sampling.append(s)
        # The grammar masks depend only on the tokens accepted so far: they are computed during the forward.
        masks = self.mask_prefetch.start([s.seq.constraint for s in sampling], self.model.config.vocab_size)
        try:
            logits = self._logits(scheduled, ids, positions, prompt_rows + sample_rows, interrupt)
        except BaseException:
            with contextlib.suppress(Exception):  # no constraint may change while its mask is being computed
                masks()
            raise
        result = StepResult(prompt_logprobs=self._score_prompts(logits[: len(prompt_rows)], scored))
        logits = logits[len(prompt_rows) :]  # (num_sampling_seqs, vocab)
        params = [s.seq.params for s in sampling]
        seqs = [SeqTokens(s.seq.prompt_token_ids, s.seq.output_token_ids, s.seq.stop_ids) for s in sampling]
        processed = apply_bitmasks(apply_processors(logits, params, seqs), masks())
        tokens = sample(processed, params, [len(s.seq.output_token_ids) for s in sampling])
        result.tokens = {s.seq.seq_id: t for s, t in zip(sampling, tokens, strict=True)}
        result.logprobs = _sampled_logprobs(logits, sampling, tokens)
        return result

    def _logits(
        self,
        scheduled: list[ScheduledSeq],
        ids: list[int],
        positions: list[int],
        rows: list[int],
        interrupt: Interrupt | None = None,
    ) -> torch.Tensor:
        """``[len(rows), vocab]`` fp32 logits of the flat ``rows``; a plain decode step replays the graphs."""
        steps = [SeqStep(s.seq.seq_id, s.num_computed_tokens, s.num_new) for s in scheduled]
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(steps) and rows == list(range(len(steps))):
            return graphs.run(steps, ids)  # (num_seqs, vocab): every sequence of a decode step samples
        with self.prepare_attention(steps, self.model.config.num_attention_heads) as attention:
            return self.model(
                torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                attention if interrupt is None else _interruptible(attention, interrupt),
                torch.tensor(rows, dtype=torch.int64, device=self.device),
            )  # (len(rows), vocab)

    @staticmethod
    def _score_prompts(logits: torch.Tensor, scored: list[tuple[ScheduledSeq, range]]) -> dict[str, list[TokenLogprob]]:
        """Prompt token log-probabilities per sequence from ``logits [num_prompt_rows, vocab]`` (in order)."""
        out, row = {}, 0
        for s, targets in scored:
            prompt, n = s.seq.prompt_token_ids, len(targets)
            num_top = s.seq.params.prompt_logprobs
            out[s.seq.seq_id] = token_logprobs(logits[row : row + n], [prompt[t] for t in targets], [num_top] * n)
            row += n
        return out


def _interruptible(attention: AttentionFn, interrupt: Interrupt) -> AttentionFn:
    """``attention`` that first asks ``interrupt`` and raises :class:`StepInterrupted` when it says so."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if interrupt():
            raise StepInterrupted(f"step interrupted before the attention of layer {layer}")
        return attention(layer, q, k, v)

    return attend


@dataclass
class StepResult:
    """What one step yields per sequence id: ``tokens`` sampled; ``logprobs`` of those tokens (sequences whose
    params ask); ``prompt_logprobs``: prompt tokens newly scored this step, in prompt order."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


def _sampled_logprobs(logits: torch.Tensor, sampling: list[ScheduledSeq], tokens: list[int]) -> dict[str, TokenLogprob]:
    """Log-probabilities of the sampled ``tokens`` under the raw ``logits [num_sampling_seqs, vocab]``."""
    rows = [i for i, s in enumerate(sampling) if s.seq.params.logprobs is not None]
    if not rows:
        return {}
    found = token_logprobs(logits[rows], [tokens[i] for i in rows], [sampling[i].seq.params.logprobs for i in rows])
    return {sampling[i].seq.seq_id: lp for i, lp in zip(rows, found, strict=True)}
