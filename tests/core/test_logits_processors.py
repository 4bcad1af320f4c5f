"""Logits processors: exact values of each penalty, bias and min_tokens, untouched rows, validation."""

import pytest
import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.logits_processors import SeqTokens, apply_processors
from infinite_llm.core.sampler import sample
from infinite_llm.core.sampling import SamplingParams

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])


def processed(params: SamplingParams, prompt=(0,), output=(), stop_ids=()) -> list[float]:
    out = apply_processors(LOGITS[None].clone(), [params], [SeqTokens(list(prompt), list(output), tuple(stop_ids))])
    return out[0].tolist()


def test_frequency_and_presence_penalties_count_output_tokens_only():
    # token 3 generated twice, token 1 once; token 0 only in the prompt (not penalized)
    got = processed(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[0], output=[3, 1, 3])
    assert got == [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25, -2.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    got = processed(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3])
    assert got == [1.0, -2.0, 0.5, 1.5, -2.0]


def test_logit_bias_adds_to_the_listed_tokens_and_can_ban_or_force_one():
    assert processed(SamplingParams(logit_bias={2: 1.5, 4: -100})) == [2.0, -1.0, 2.0, 3.0, -102.0]
    forced = SamplingParams(temperature=0, logit_bias={1: 100})
    assert sample(apply_processors(LOGITS[None], [forced], [SeqTokens([0], [])]), [forced], [0]) == [1]


def test_min_tokens_masks_stop_ids_until_that_many_tokens_exist():
    p = SamplingParams(min_tokens=2)
    assert processed(p, output=[1], stop_ids=[3]) == [2.0, -1.0, 0.5, float("-inf"), -2.0]
    assert processed(p, output=[1, 2], stop_ids=[3]) == LOGITS.tolist()


def test_rows_without_processors_are_not_copied_and_the_input_is_unchanged():
    logits = torch.stack([LOGITS, LOGITS])
    plain = SamplingParams()
    assert apply_processors(logits, [plain, plain], [SeqTokens([0], [])] * 2) is logits
    out = apply_processors(logits, [plain, SamplingParams(presence_penalty=1.0)], [SeqTokens([0], [3])] * 2)
    assert out[0].tolist() == LOGITS.tolist() and out[1, 3].item() == 2.0
    assert logits[1].tolist() == LOGITS.tolist()  # raw logits stay raw (logprobs are computed from them)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": (2, -3)}, "stop_token_ids"),
    ],
)
def test_out_of_range_processor_parameters_are_rejected_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
