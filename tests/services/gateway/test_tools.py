"""Tool calls at the gateway without a mesh: tool_choice validation, the Hermes format of ``auto``, the
schemas of ``required`` and named calls, and how history is rendered for templates with and without tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.engine.grammar import grammar_of
from infinite_llm.services.gateway.tools import parse_calls, render_history, tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object


class _HF:
    def __init__(self, template: str) -> None:
        self.chat_template = template


class Tok:
    """The two tokenizer attributes the tool code reads."""

    def __init__(self, template: str) -> None:
        self.hf = _HF(template)
        self.template_renders_tools = "tools" in template


CHATML = Tok("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}")
HERMES = Tok("{% if tools %}<tools>{{ tools }}</tools>{% endif %}... <tool_call>{{ call }}</tool_call> ...")


def test_auto_is_a_400_unless_the_template_defines_a_tool_call_format():
    for choice in ("auto", None):
        with pytest.raises(InvalidRequest) as e:
            tool_plan([WEATHER], choice, CHATML)
        assert e.value.param == "tool_choice"
    assert tool_plan([WEATHER], "auto", HERMES).mode == "auto"


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    plan = tool_plan([WEATHER, TIME], "auto", HERMES)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_calls(plan, text)
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"})
    ]
    assert calls[0]["id"].startswith("call_")
    assert parse_calls(plan, "No tools needed.") == ("No tools needed.", [])


def test_required_and_named_calls_are_constrained_by_the_functions_schemas():
    required = tool_plan([WEATHER, TIME], "required", CHATML)
    schema = json.loads(required.json_schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)  # at least one call
    content, calls = parse_calls(required, '[{"name": "get_time", "parameters": {}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, CHATML)
    assert json.loads(named.json_schema) == WEATHER["function"]["parameters"]
    assert parse_calls(named, '{"city": "Rome"}')[1][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
    }


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([{"type": "function"}], "required", "tools.0"),
        (None, "required", "tool_choice"),
    ],
)
def test_bad_tools_or_tool_choice_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidRequest) as e:
        tool_plan(tools, choice, CHATML)
    assert e.value.param == param


LIST = {  # parameters whose $refs point into themselves
    "type": "function",
    "function": {
        "name": "walk",
        "parameters": {
            "type": "object",
            "properties": {"head": {"$ref": "#/$defs/node"}},
            "required": ["head"],
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"value": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                    "required": ["value"],
                }
            },
        },
    },
}


def test_required_keeps_each_functions_refs_pointing_into_its_own_parameters():
    schema = tool_plan([WEATHER, LIST], "required", CHATML).json_schema
    assert '"json_schema"' in grammar_of(schema)  # "#/$defs/node" resolves inside the array's item
    jsonschema.validate(
        [{"name": "walk", "parameters": {"head": {"value": 1, "next": {"value": 2}}}}], json.loads(schema)
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "walk", "parameters": {"head": {"next": {}}}}], json.loads(schema))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"$ref": "#"}, "the JSON schema describes no finite JSON value"),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "describes no finite JSON value"),
        ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ],
)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_an_enforced_function_schema_that_cannot_be_enforced_is_a_400_naming_its_parameters(
    parameters, message, choice
):
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    with pytest.raises(InvalidRequest) as e:
        tool_plan([WEATHER, bad], choice, CHATML)
    assert e.value.param == "tools.1.function.parameters"
    assert message in e.value.message
    assert tool_plan([WEATHER, bad], "none", CHATML).json_schema is None  # shown to the model, not enforced


def test_history_keeps_calls_and_results_with_or_without_a_tool_template():
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    plan = tool_plan([WEATHER], "required", CHATML)
    messages, template_tools = render_history(history, plan, CHATML)
    assert template_tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'}
    assert messages[3] == history[2]
    messages, template_tools = render_history(history, tool_plan([WEATHER], "auto", HERMES), HERMES)
    assert template_tools == [WEATHER | {"function": {**WEATHER["function"]}}]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_calls_cut_short_by_max_tokens_are_still_calls_with_the_arguments_so_far():
    """The grammar makes a required or named answer nothing but calls: cut by ``max_tokens`` it is the
    complete calls, then the last one's name with its arguments' text so far (OpenAI's and vLLM's shape for
    a named call cut by ``length``), never the grammar's JSON as content."""
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, CHATML)
    assert parse_calls(named, '{"city": "Ro')[1][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Ro'}
    assert parse_calls(named, "")[1][0]["function"] == {"name": "get_weather", "arguments": ""}
    required = tool_plan([WEATHER, TIME], "required", CHATML)

    def named_args(text: str) -> list[tuple[str, str]]:
        content, calls = parse_calls(required, text)
        assert content is None, content
        return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]

    assert named_args('[{"name": "get_weather", "parameters": {"city": "Os') == [("get_weather", '{"city": "Os')]
    assert named_args('[{"name":"get_time","parameters":{}}, {"name": "get_weather", "parameters": {') == [
        ("get_time", "{}"),
        ("get_weather", "{"),
    ]
    assert named_args('[{"name": "get_time", "parameters": {}},') == [("get_time", "{}")]
    for cut in ("[", "[{", '[{"na', '[ {"name": "get_', '[{"name": "get_time"'):  # no name whole yet: no call
        assert parse_calls(required, cut) == (None, []), cut  # and the grammar's JSON is not content either
    assert parse_calls(required, "Sorry, no.") == ("Sorry, no.", [])
    # the model's own text of the parameters, as a stream sends it (not re-serialized by json.dumps)
    assert named_args('[{"name":"get_weather","parameters":{"city":"Paris"}}]') == [("get_weather", '{"city":"Paris"}')]
    assert named_args('[{"parameters": {"city": "Rome"}, "name": "get_weather"}]') == [  # reordered: read whole
        ("get_weather", '{"city": "Rome"}')
    ]


REQUIRED_ANSWERS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" [}"}}, {"name":"get_time","parameters":{}}]',
    '[ {"name": "get_time", "parameters": {"n": 12}} ,\n {"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    '[{"name": "get_time", "parameters": 12}, {"name": "get_weather", "parameters": ["a", {"b": "}"}]}]',
    '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Os',  # cut
    '[{"name": "get_time", "parameters": {}}, {"na',  # cut inside the second item's head
    '[{"name":"get_weather","parameters":{"city":"Paris","n":[1,2]}}]',  # compact: json.dumps would add spaces
]


@pytest.mark.parametrize("answer", REQUIRED_ANSWERS)
@pytest.mark.parametrize("seed", range(20))
def test_a_streamed_required_answer_yields_the_calls_of_the_whole_answer(answer, seed):
    """Fed in random pieces (1 to 6 characters, as tokens come), the deltas join into the calls the whole
    answer parses to: one head per call (index, id, name, empty arguments) before its arguments' pieces,
    and arguments that are the model's own text of the parameters, no more: the same text as the whole
    parse's."""
    import random

    from infinite_llm.services.gateway.tools import RequiredCallStream

    rng, stream, deltas, at = random.Random(seed), RequiredCallStream(), [], 0
    while at < len(answer):
        n = rng.randint(1, 6)
        deltas += stream.feed(answer[at : at + n])
        at += n
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["function"]["arguments"] == "" and d["id"].startswith("call_")
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls))) and stream.calls == len(calls)
    _, whole = parse_calls(tool_plan([WEATHER, TIME], "required", CHATML), answer)
    assert [c["name"] for c in calls.values()] == [c["function"]["name"] for c in whole]
    assert [c["arguments"] for c in calls.values()] == [c["function"]["arguments"] for c in whole]


def test_a_required_answer_that_is_not_calls_streams_nothing():
    from infinite_llm.services.gateway.tools import RequiredCallStream

    stream = RequiredCallStream()
    assert stream.feed("Sorry, ") == [] and stream.feed('[{"name": "x", "parameters": {}}]') == []
    assert stream.calls == 0


HERMES_ANSWERS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <b>"}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Oslo"}}\n</tool_call>\nDone.',
    "I think <tool_ not a tag, and < tool_call> neither.",
    'Before <tool_call>{"arguments": {}, "name": "get_time"}</tool_call> after',  # unreadable: dropped
    '<tool_call>{"name": "get_time", "arguments": 7}</tool_call>',
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","n":[1,2]}}</tool_call>',  # compact
]


@pytest.mark.parametrize("answer", HERMES_ANSWERS)
@pytest.mark.parametrize("seed", range(20))
def test_a_streamed_hermes_answer_yields_the_content_and_calls_of_the_whole_answer(answer, seed):
    """``auto`` with a Hermes template, fed in random pieces: the content deltas join into the whole parse's
    content (whitespace at its ends aside: a stream cannot take back what it sent), the call deltas into its
    calls, and no tag's text ever reaches the content or the arguments."""
    import random

    from infinite_llm.services.gateway.tools import HermesCallStream

    rng, stream, content, deltas, at = random.Random(seed), HermesCallStream(), "", [], 0
    while at < len(answer):
        n = rng.randint(1, 6)
        text, more = stream.feed(answer[at : at + n])
        content, deltas, at = content + text, deltas + more, at + n
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:  # a head: empty arguments, or whole ones for a call whose name did not come first
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
        else:
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    want_content, want_calls = parse_calls(tool_plan([WEATHER, TIME], "auto", HERMES), answer)
    assert content.strip() == (want_content or "")
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert all("tool_call" not in c["arguments"] for c in calls.values())
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [  # the same text, not only equal JSON
        (c["function"]["name"], c["function"]["arguments"]) for c in want_calls
    ]


def test_a_streamed_auto_answer_sends_its_text_as_content_and_its_calls_as_tool_call_deltas():
    """The gateway's chat stream over an ``auto`` answer in the Hermes format, token pieces as the router
    sends them: the role, content deltas, the call's head then its arguments in pieces, and ``tool_calls``
    as the finish reason; the same answer with no call finishes ``stop`` with all of its text as content."""
    import asyncio

    from infinite_llm.client.sdk import CompletionChunk
    from infinite_llm.services.gateway.handlers import chat_chunks
    from infinite_llm.services.gateway.params import Plan

    def stream(pieces: list[str]) -> list:
        plan = Plan("chatcmpl-1", "m", [[1, 2]], 1, tools=tool_plan([WEATHER, TIME], "auto", HERMES))

        async def events():
            for n, piece in enumerate(pieces):
                last = n == len(pieces) - 1
                yield 0, CompletionChunk("r", [n], piece, finish_reason="stop" if last else None)

        async def collect() -> list:
            return [c async for c in chat_chunks(plan, events(), False, None)]

        return [c.choices[0] for c in asyncio.run(collect())]

    pieces = ["Let me", " check.", "\n<tool", '_call>\n{"name": "get_', 'weather", "argu', 'ments": {"city"', ': "Par',
              'is"}}\n</tool_call>']  # fmt: skip
    choices = stream(pieces)
    assert choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in choices) == "Let me check."
    calls = [t for c in choices for t in c.delta.tool_calls or []]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["index"] == 0
    assert len(calls) > 2 and json.loads("".join(t["function"]["arguments"] for t in calls)) == {"city": "Paris"}
    assert choices[-1].finish_reason == "tool_calls"
    plain = stream(["No tools <tool", " needed.  "])
    assert "".join(c.delta.content or "" for c in plain) == "No tools <tool needed.  "
    assert plain[-1].finish_reason == "stop" and not any(c.delta.tool_calls for c in plain)


@pytest.mark.parametrize("pieces", [["["], ["[", '{"', "name"], ["[", '{"name": "get_', "time"]], ids=str)
def test_a_required_answer_cut_before_its_first_name_streams_and_answers_no_content(pieces):
    """``tool_choice: required`` with a small ``max_tokens``: the answer (the grammar's JSON array) is cut
    before a call's name is whole. Streamed: the role, then only the finish (``length``), no content delta
    and no call; unary: ``content`` null and no ``tool_calls`` (the walkthrough saw ``"content": "["``)."""
    import asyncio

    from infinite_llm.client.sdk import CompletionChunk
    from infinite_llm.services.gateway.handlers import chat_chunks, chat_message
    from infinite_llm.services.gateway.params import Plan

    plan = Plan("chatcmpl-1", "m", [[1, 2]], 1, tools=tool_plan([WEATHER, TIME], "required", CHATML))

    async def events():
        for n, piece in enumerate(pieces):
            yield 0, CompletionChunk("r", [n], piece, finish_reason="length" if n == len(pieces) - 1 else None)

    async def collect() -> list:
        return [c async for c in chat_chunks(plan, events(), False, None)]

    choices = [c.choices[0] for c in asyncio.run(collect())]
    assert [(c.delta.role, c.delta.content, c.delta.tool_calls, c.finish_reason) for c in choices] == [
        ("assistant", "", None, None),
        (None, None, None, "length"),
    ]
    message, reason = chat_message(plan, "".join(pieces), "length")
    assert (message.content, message.tool_calls, reason) == (None, None, "length")


def test_a_long_streamed_argument_is_decoded_once_it_can_be_whole_not_after_every_piece(monkeypatch):
    """Decoding the arguments after every piece reads them again each time (quadratic in their length): the
    stream decodes only once the value's brackets balance. A 2,000-character argument fed a character at a
    time: a handful of decodes instead of ~2,000, and the same call as the whole parse."""
    from infinite_llm.services.gateway import tools

    decodes = []

    class CountingDecoder(json.JSONDecoder):
        def raw_decode(self, s, idx=0):  # noqa: ANN001, ANN201
            decodes.append(idx)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(tools.json, "JSONDecoder", CountingDecoder)
    city = "x" * 1000 + '\\"}] {[' + "y" * 993  # brackets and an escaped quote inside the string hide nothing
    answer = '[{"name": "get_weather", "parameters": {"city": "' + city + '"}}]'
    stream, deltas = tools.RequiredCallStream(), []
    for c in answer:
        deltas += stream.feed(c)
    assert len(decodes) <= 3, len(decodes)
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    _, whole = parse_calls(tool_plan([WEATHER, TIME], "required", CHATML), answer)
    assert json.loads(arguments) == json.loads(whole[0]["function"]["arguments"]) == {"city": json.loads(f'"{city}"')}
