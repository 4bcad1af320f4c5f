"""Sampling controls and the smaller OpenAI/vLLM surface through the real gateway of a local mesh.

Penalties and biases: greedy text equals HF transformers' ``repetition_penalty`` on the same weights, a
+100 bias forces its token, ``min_tokens`` holds off EOS; ``continuous_usage_stats``, ``GET
/v1/models/{id}``, ``HEAD`` on ``/metrics`` and ``/health``; fields not implemented are 400s naming them.
"""

from __future__ import annotations

import json

import pytest
import torch

PROMPT = "The list of colors: red, blue, green, red, blue, green, red,"


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_repetition_penalty_greedy_text_equals_hf(http, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    mask = torch.ones(1, len(ids), dtype=torch.long)
    ref = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=8, do_sample=False, repetition_penalty=1.5, attention_mask=mask
    )[0, len(ids) :].tolist()
    body = complete(http, prompt=PROMPT, max_tokens=8, repetition_penalty=1.5, ignore_eos=True)
    assert body["choices"][0]["text"] == tokenizer.decode(ref)


def test_logit_bias_forces_or_bans_a_token_and_penalties_change_greedy_output(http, tokenizer):
    forced = tokenizer.encode(" zebra", add_special_tokens=False)[0]
    body = complete(http, prompt=PROMPT, max_tokens=3, logit_bias={str(forced): 100}, ignore_eos=True)
    assert body["choices"][0]["text"] == tokenizer.decode([forced] * 3)
    plain = complete(http, prompt=PROMPT, max_tokens=6, ignore_eos=True)["choices"][0]["text"]
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = complete(http, prompt=PROMPT, max_tokens=6, logit_bias={str(first): -100}, ignore_eos=True)
    assert not banned["choices"][0]["text"].startswith(tokenizer.decode([first]))
    penalized = complete(http, prompt=PROMPT, max_tokens=6, frequency_penalty=2, presence_penalty=2, ignore_eos=True)
    assert penalized["choices"][0]["text"] != plain


def test_min_tokens_keeps_generating_past_eos(http):
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 80})
    short = r.json()["usage"]["completion_tokens"]
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    body = {"messages": messages, "temperature": 0, "max_tokens": 80, "min_tokens": short + 10}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= short + 10


def test_continuous_usage_stats_put_usage_so_far_on_every_chunk(http):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"] is not None for e in events) and counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == []  # include_usage's final chunk, as before


def test_continuous_usage_stats_count_each_choice_its_own_tokens_from_0_on_the_role_chunk(http):
    """As vLLM: a chunk's usage counts its choice's tokens so far (not every choice's together), the role's
    chunk 0; the final usage counts them all."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "seed": 1, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-1]:
        (choice,) = e["choices"]
        per_choice[choice["index"]].append(e["usage"]["completion_tokens"])
        if choice["delta"].get("role") == "assistant":
            assert e["usage"]["completion_tokens"] == 0
    for counts in per_choice.values():
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 4, counts
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_get_model_by_id_and_head_on_metrics_and_health(http):
    served = http.get("/v1/models").json()["data"][0]
    assert http.get(f"/v1/models/{served['id']}").json() == served
    missing = http.get("/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for path in ("/metrics", "/health"):
        r = http.head(path)
        assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_p": 0.1}, "min_p"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop_token_ids": [2, 99999999]}, "stop_token_ids"),
        ({"stop_token_ids": [49152], "stream": True}, "stop_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_controls_out_of_range_or_not_implemented_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json={"prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
