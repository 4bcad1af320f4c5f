"""Model runner: turns a scheduler step into flat model inputs, runs the dense layers, samples.

The runner never sees the scheduler's queues (nano-vllm's split): it receives the scheduled sequences and
an attention backend that knows where KV lives (a ``DistAttention`` over local rManagers here, over remote
attention servers in the mesh).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infinite_llm.core.decode_graphs import DecodeGraphs
from infinite_llm.core.dist_attention import StepAttention
from infinite_llm.core.model import LlamaForCausalLM
from infinite_llm.core.rmanager import SeqStep
from infinite_llm.core.sampling import sample
from infinite_llm.core.scheduler import ScheduledSeq

PrepareFn = Callable[[list[SeqStep], int], StepAttention]  # (step's sequences, num_heads) -> attention


class ModelRunner:
    """Runs ``model`` over a step with attention from ``prepare_attention``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        prepare_attention: PrepareFn,
        device: torch.device | str = "cpu",
        decode_graphs: DecodeGraphs | None = None,
    ):
        """``decode_graphs``: where decode steps that fit go (CUDA graphs, or their static buffers run
        eagerly); every other step runs eagerly through ``prepare_attention``."""
        self.model = model
        self.prepare_attention = prepare_attention
        self.device = torch.device(device)
        self.decode_graphs = decode_graphs

    def run(self, scheduled: list[ScheduledSeq]) -> dict[str, int]:
        """One step. Returns the sampled next token of every sequence whose step ends its known tokens.

        Inputs are flattened: ``input_ids, positions [num_tokens]`` int64, sequences in ``scheduled`` order.
        """
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for s in scheduled:
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + s.num_new
            ids.extend(s.seq.all_token_ids[lo:hi])
            positions.extend(range(lo, hi))
            if s.samples:
                logit_rows.append(len(ids) - 1)
        steps = [SeqStep(s.seq.seq_id, s.num_computed_tokens, s.num_new) for s in scheduled]
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(steps) and len(logit_rows) == len(steps):
            logits = graphs.run(steps, ids)  # (num_seqs, vocab): every sequence of a decode step samples
        else:
            with self.prepare_attention(steps, self.model.config.num_attention_heads) as attention:
                logits = self.model(
                    torch.tensor(ids, dtype=torch.int64, device=self.device),
                    torch.tensor(positions, dtype=torch.int64, device=self.device),
                    attention,
                    torch.tensor(logit_rows, dtype=torch.int64, device=self.device),
                )  # (num_sampling_seqs, vocab)
        sampling = [s for s in scheduled if s.samples]
        tokens = sample(logits, [s.seq.params for s in sampling], [len(s.seq.output_token_ids) for s in sampling])
        return {s.seq.seq_id: t for s, t in zip(sampling, tokens, strict=True)}
