"""Log-probabilities of sampled and prompt tokens equal HF transformers' log-softmax on the same weights.

The reference is one HF forward over prompt + output in fp32: ``log_softmax(logits[j])[ids[j + 1]]`` scores
token ``j + 1``. Tolerance: the engine's logits agree with HF's within 1e-3 (test_engine_vs_hf.py), and a
log-softmax moves by at most twice the largest logit difference, so log-probabilities agree within 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.sampling import SamplingParams

LOGPROB_TOL = 2e-3
PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which plants turn light, water and carbon dioxide into",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: row ``j`` is HF's log-softmax over the token after ``ids[: j + 1]``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def assert_matches(found, ref: torch.Tensor, ids: list[int], num_top: int) -> None:
    """``found[j]`` (a TokenLogprob) scores ``ids[j]`` with ``ref[j]``; its top ids are HF's top ids."""
    assert [f.token_id for f in found] == ids
    want = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
    got = torch.tensor([f.logprob for f in found])
    assert (got - want).abs().max().item() < LOGPROB_TOL
    for f, row in zip(found, ref, strict=True):
        top = row.topk(num_top)
        assert [t for t, _ in f.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in f.top]), top.values, atol=LOGPROB_TOL)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_token_logprobs_equal_hf_log_softmax_of_raw_logits(make_engine, hf_model, temperature):
    engine = make_engine(block_size=16, num_kv_blocks=128, num_partitions=2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, logprobs=5, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        assert len(out.logprobs) == len(out.token_ids) == 12  # the final output carries them all
        ref = hf_logprobs(hf_model, ids + out.token_ids)[len(ids) - 1 :]
        assert_matches(out.logprobs, ref, out.token_ids, 5)
        if temperature == 0:  # greedy picks the most likely token: its logprob is the top one
            assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)
    assert outs[0].prompt_logprobs is None


@pytest.mark.parametrize("chunk", [7, 2048])
def test_prompt_logprobs_over_chunked_prefill_equal_hf_and_max_tokens_0_generates_nothing(make_engine, hf_model, chunk):
    engine = make_engine(block_size=4, num_kv_blocks=256, num_partitions=3, max_num_batched_tokens=chunk)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        assert_matches(out.prompt_logprobs[1:], hf_logprobs(hf_model, ids), ids[1:], 3)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_echo_and_logprobs_together_stream_prompt_first_then_one_per_token(make_engine, hf_model):
    engine = make_engine(block_size=8, num_kv_blocks=128, max_num_batched_tokens=5)
    ids = engine.tokenizer.encode(PROMPTS[1])
    outs = list(engine.stream(ids, SamplingParams(max_tokens=6, temperature=0, logprobs=0, prompt_logprobs=0)))
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    streamed = [lp for o in outs for lp in o.new_logprobs]
    assert [len(o.new_logprobs) for o in outs] == [len(o.new_token_ids) for o in outs]
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = hf_logprobs(hf_model, ids + tokens)
    assert_matches(outs[0].prompt_logprobs[1:] + streamed, ref, ids[1:] + tokens, 0)
    assert all(lp.top == () for lp in streamed)


def test_preempted_sequence_scores_its_prompt_once(make_engine, hf_model):
    engine = make_engine(block_size=4, num_kv_blocks=128, max_num_batched_tokens=6)
    ids = engine.tokenizer.encode(PROMPTS[1])
    rid = engine.add_request(ids, SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1, logprobs=1))
    outs, preempted = [], False
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == rid]
        if len(outs) == 2 and not preempted:
            assert engine.recompute_all() == 1  # prefilled again from its tokens, over several chunks
            preempted = True
    assert outs[-1].num_preemptions == 1
    tokens = outs[-1].token_ids
    ref = hf_logprobs(hf_model, ids + tokens)
    assert len(outs[0].prompt_logprobs) == len(ids)
    assert_matches(outs[0].prompt_logprobs[1:] + [lp for o in outs for lp in o.new_logprobs], ref, ids[1:] + tokens, 1)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ],
)
def test_logprob_counts_out_of_range_are_invalid_requests_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
