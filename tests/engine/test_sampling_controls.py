"""Penalties, logit bias and min_tokens in the engine: greedy tokens equal HF transformers' own processors
(``repetition_penalty``, ``min_new_tokens``) or a greedy loop over HF logits with OpenAI's formula applied."""

from __future__ import annotations

import torch

from infinite_llm.core.sampling import SamplingParams

PROMPT = "The list of colors: red, blue, green, red, blue, green, red,"


def hf_generate(hf_model, ids: list[int], n: int, **kwargs) -> list[int]:
    mask = torch.ones(1, len(ids), dtype=torch.long)
    out = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, attention_mask=mask, pad_token_id=0, **kwargs
    )
    return out[0, len(ids) :].tolist()


def test_repetition_penalty_tokens_equal_hf_repetition_penalty(make_engine, hf_model):
    engine = make_engine(block_size=16, num_kv_blocks=64)
    ids = engine.tokenizer.encode(PROMPT)
    (plain, penalized) = engine.generate(
        [ids, ids],
        [
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.5),
        ],
    )
    assert penalized.token_ids == hf_generate(hf_model, ids, 10, repetition_penalty=1.5)
    assert plain.token_ids == hf_generate(hf_model, ids, 10)
    assert penalized.token_ids != plain.token_ids  # the penalty changed the output of this prompt


def test_frequency_presence_penalties_and_logit_bias_equal_a_greedy_loop_over_hf_logits(make_engine, hf_model):
    engine = make_engine(block_size=16, num_kv_blocks=64)
    ids = engine.tokenizer.encode(PROMPT)
    bias = {engine.tokenizer.encode(" blue", add_special_tokens=False)[0]: -5.0}
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.6, logit_bias=bias
    )
    (out,) = engine.generate([ids], params)
    want: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + want])).logits[0, -1].float()
        for t, b in bias.items():
            logits[t] += b
        counts = torch.bincount(torch.tensor(want, dtype=torch.long), minlength=logits.shape[0]).float()
        logits -= 1.2 * counts + 0.6 * (counts > 0).float()
        want.append(int(logits.argmax()))
    assert out.token_ids == want


def test_min_tokens_holds_off_eos_as_hf_min_new_tokens_does(make_engine, hf_model):
    engine = make_engine(block_size=16, num_kv_blocks=64)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Reply with the single word: yes"}])
    (short,) = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0))
    assert short.finish_reason == "stop"
    n = len(short.token_ids) + 8  # EOS came before this
    (held,) = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0, min_tokens=n))
    eos = list(engine.tokenizer.eos_token_ids)
    ref = hf_generate(hf_model, ids, 64, min_new_tokens=n, eos_token_id=eos)
    assert len(held.token_ids) >= n
    assert held.token_ids == ref[: len(held.token_ids)]
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_a_stop_string_does_not_end_the_output_before_min_tokens(make_engine):
    engine = make_engine(block_size=16, num_kv_blocks=64)
    ids = engine.tokenizer.encode(PROMPT)
    (free,) = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, stop=[","]))
    assert free.finish_reason == "stop" and len(free.token_ids) < 4
    (held,) = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, stop=[","], min_tokens=4))
    assert len(held.token_ids) >= 4 and held.token_ids[: len(free.token_ids)] == free.token_ids
    assert held.text.count(",") >= 1  # the stop string is kept in text written before min_tokens
