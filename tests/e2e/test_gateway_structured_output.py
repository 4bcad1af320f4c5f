"""Structured output through the real gateway of a local mesh, with the official ``openai`` client:
``response_format`` ``json_object`` and ``json_schema`` (``strict``) answers always parse and validate, on
chat and completions, unary and streamed; a schema that cannot be enforced is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import pytest

# Bounded schemas (string lengths, integer ranges, no extra properties): a small model may otherwise write
# until max_tokens cuts the value, which no grammar can prevent.
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "sky": {"enum": ["sunny", "cloudy", "rainy"]},
            "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
        },
        "required": ["city", "sky", "celsius"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 160  # the e2e mesh's KV memory holds 384 tokens per request (24 rBlocks of 16)
QUESTION = [{"role": "user", "content": "Describe the weather in Paris today as JSON."}]


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_json_schema_answers_parse_and_validate_for_every_schema_and_sampling(oai):
    for name, schema in SCHEMAS.items():
        for temperature in (0.0, 1.0):
            reply = oai.chat.completions.create(
                model="",
                messages=QUESTION,
                response_format=response_format(name),
                temperature=temperature,
                seed=5,
                max_tokens=MAX_TOKENS,
            )
            assert reply.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_streamed_and_on_completions(oai, http):
    chunks = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}],
        response_format={"type": "json_object"},
        temperature=0,
        stream=True,
        max_tokens=MAX_TOKENS,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    r = http.post(
        "/v1/completions",
        json={"prompt": "The weather in Paris as JSON:", "max_tokens": 120, "response_format": response_format("tags")},
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMAS["tags"])


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "yaml"}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, None),
    ],
)
def test_response_formats_that_cannot_be_enforced_are_400s(http, fmt, param):
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == (param or "response_format.json_schema.schema")


@pytest.mark.parametrize(
    ("schema", "ref"),
    [
        ({"$ref": "#"}, "'#'"),
        ({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}, "'#'"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "'#/$defs/a'"),
    ],
)
def test_a_schema_with_no_finite_value_is_a_400_not_an_empty_answer(http, schema, ref):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "JSON:"})):
        r = http.post(path, json={**body, "response_format": fmt, "max_tokens": 8})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] is None
        assert error["param"] == "response_format.json_schema.schema"
        assert error["message"].startswith("the JSON schema describes no finite JSON value")
        assert f"self-referring $ref: {ref}" in error["message"]
