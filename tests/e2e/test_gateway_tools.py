"""Tool calls through the real gateway of a local mesh with the official ``openai`` client (SmolLM2, whose
chat template defines no tool-call format): a named function and ``required`` are enforced by the
function's JSON schema, unary and streamed; ``auto`` is a 400 for this model; ``none`` answers in text;
assistant tool calls and tool results in the history reach the prompt."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from infinite_llm.models.registry import load_tokenizer, resolve_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 160  # the e2e mesh holds 384 tokens per request
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_function_is_called_with_arguments_that_validate(oai):
    reply = oai.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, temperature=0, max_tokens=MAX_TOKENS
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_named_call_cut_by_max_tokens_is_a_call_with_its_arguments_so_far(oai):
    """As OpenAI's: ``length``, and a tool call whose arguments are the prefix the model wrote of those it
    writes with room (not the arguments' JSON as content, which a client reading tool_calls never sees)."""
    kwargs = dict(model="", messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, temperature=0)
    whole = oai.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS).choices[0].message.tool_calls[0]
    for stream in (False, True):
        if stream:
            chunks = list(oai.chat.completions.create(**kwargs, max_tokens=4, stream=True))
            calls = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or []]
            reasons = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
            assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
            arguments, reason = "".join(c.function.arguments or "" for c in calls), reasons[-1]
        else:
            choice = oai.chat.completions.create(**kwargs, max_tokens=4).choices[0]
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            arguments, reason = call.function.arguments, choice.finish_reason
        assert reason == "length"
        assert arguments and whole.function.arguments.startswith(arguments) and arguments != whole.function.arguments


def test_required_calls_one_or_more_listed_functions_with_valid_arguments(oai):
    for temperature in (0.0, 1.0):
        reply = oai.chat.completions.create(
            model="",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=temperature,
            seed=9,
            max_tokens=MAX_TOKENS,
        )
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
            jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


def test_streamed_tool_calls_arrive_as_openai_deltas(oai):
    chunks = list(
        oai.chat.completions.create(
            model="",
            messages=ASK,
            tools=[WEATHER],
            tool_choice=NAMED,
            temperature=0,
            stream=True,
            max_tokens=MAX_TOKENS,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head, *pieces = [call for d in deltas for call in d.tool_calls]
    # as OpenAI streams a call: its id, type and name first, then its arguments piece by piece
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(pieces) > 1 and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    arguments = "".join(p.function.arguments for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = oai.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_tokens=MAX_TOKENS
    )
    assert whole.choices[0].message.tool_calls[0].function.arguments == arguments


def test_streamed_required_calls_arrive_call_by_call_with_their_arguments_in_pieces(oai):
    kwargs = dict(model="", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    streamed = oai.chat.completions.create(
        **kwargs, stream=True, logprobs=True, stream_options={"include_usage": True}, max_tokens=MAX_TOKENS
    )
    *chunks, last = list(streamed)
    deltas = [c.choices[0].delta for c in chunks if c.choices[0].delta.tool_calls]
    calls: dict[int, dict] = {}
    for piece in (call for d in deltas for call in d.tool_calls):
        if piece.id is not None:  # a call's head comes first: its index, id, type and name
            assert piece.index not in calls and piece.type == "function" and piece.function.arguments == ""
            calls[piece.index] = {"name": piece.function.name, "arguments": "", "pieces": 0}
        else:
            assert piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments
            calls[piece.index]["pieces"] += 1
    assert calls and sorted(calls) == list(range(len(calls)))
    assert any(c["pieces"] > 1 for c in calls.values())  # streamed, not one delta at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # every token's logprob streams with the calls (the answer used to be held back, its logprobs dropped)
    assert (
        sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == last.usage.completion_tokens
    )
    whole = oai.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS).choices[0].message.tool_calls
    assert [c["name"] for c in calls.values()] == [c.function.name for c in whole]
    assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in whole]  # the same text


def test_auto_is_a_400_for_a_model_without_a_tool_format_and_none_answers_in_text(oai):
    for choice in ("auto", openai.NOT_GIVEN):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=8)
        assert e.value.body["param"] == "tool_choice"
    reply = oai.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=12
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_tool_calls_and_results_in_the_history_reach_the_prompt(oai, default_model_path):
    tokenizer = load_tokenizer(resolve_model(None))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    reply = oai.chat.completions.create(
        model="", messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=4
    )
    listing = "You can call these functions (JSON schemas of their parameters):\n" + json.dumps(
        [
            {
                "name": "get_weather",
                "description": WEATHER["function"]["description"],
                **{"parameters": WEATHER["function"]["parameters"]},
            }
        ]
    )
    expected = tokenizer.encode_chat(
        [
            {"role": "system", "content": listing},
            *ASK,
            {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'},
            {"role": "tool", "content": "18 degrees and sunny"},
        ]
    )
    assert reply.usage.prompt_tokens == len(expected)
