"""The engine's greedy tokens and logits equal HF transformers on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from infinite_llm.core.sampling import SamplingParams
from tests.conftest import LONG_DOCUMENT

LOGITS_TOL = 1e-3
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which plants",
    "Here is a short poem about the sea:\n",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
]


class LogitsRecorder:
    """Wraps the engine's real model and keeps the logits of every step that sampled."""

    def __init__(self, engine) -> None:
        self.model = engine.runner.model
        self.config = self.model.config
        self.steps: list[torch.Tensor] = []
        engine.runner.model = self

    def __call__(self, *args):
        logits = self.model(*args)
        if logits.shape[0]:
            self.steps.append(logits.clone())
        return logits


def hf_greedy(hf_model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        pad_token_id=0,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits)  # (n, vocab)


def test_greedy_tokens_equal_hf_for_real_prompts_in_one_batch(make_engine, hf_model):
    engine = make_engine(block_size=16, num_kv_blocks=256)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(ids, SamplingParams(max_tokens=32, temperature=0))
    for prompt_ids, out in zip(ids, outs, strict=True):
        ref, _ = hf_greedy(hf_model, prompt_ids, 32)
        assert out.token_ids == ref, f"prompt {engine.tokenizer.decode(prompt_ids)!r}"
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def _chat_prompt_of_length(tokenizer, n: int) -> list[int]:
    base = tokenizer.encode("The quick brown fox jumps over the lazy dog while the sun sets behind the hills. " * 8)
    return (base * (n // len(base) + 1))[:n]


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 33, 47])
def test_tokens_and_logits_equal_hf_around_block_boundaries(make_engine, hf_model, prompt_len):
    engine = make_engine(block_size=16, num_kv_blocks=64, num_partitions=3)
    rec = LogitsRecorder(engine)
    ids = _chat_prompt_of_length(engine.tokenizer, prompt_len)
    (out,) = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    ref_tokens, ref_logits = hf_greedy(hf_model, ids, 20)
    assert out.token_ids == ref_tokens
    ours = torch.cat(rec.steps)
    assert ours.shape == ref_logits.shape
    assert (ours - ref_logits).abs().max().item() < LOGITS_TOL


def test_placement_lookahead_keeps_the_greedy_tokens_of_hf_across_block_and_partition_boundaries(make_engine, hf_model):
    """A compute instance places 2 rBlocks beyond a decode's need (``placement_lookahead_blocks``): blocks
    in the table past the step's context change no attention, at any prompt length around a boundary."""
    engine = make_engine(block_size=16, num_kv_blocks=64, num_partitions=3, placement_lookahead_blocks=2)
    ids = [_chat_prompt_of_length(engine.tokenizer, n) for n in (15, 17, 47)]
    outs = engine.generate(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt_ids, 40)[0], f"prompt of {len(prompt_ids)} tokens"
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_long_real_document_of_thousands_of_tokens_equals_hf(make_engine, hf_model):
    engine = make_engine(block_size=16, num_kv_blocks=400, num_partitions=4, max_num_batched_tokens=1024)
    text = open(LONG_DOCUMENT, encoding="utf-8").read()[:14000] + "\n\nIn one sentence, this license"
    ids = engine.tokenizer.encode(text)
    assert len(ids) > 2500
    rec = LogitsRecorder(engine)
    (out,) = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ref_tokens, ref_logits = hf_greedy(hf_model, ids, 8)
    assert out.token_ids == ref_tokens
    assert (torch.cat(rec.steps) - ref_logits).abs().max().item() < LOGITS_TOL
