"""A JSON schema that no finite JSON value matches is an invalid request naming its self-referring $refs;
recursive schemas with a way out compile (grammar_of: the check the gateway and the engine both make)."""

from __future__ import annotations

import json

import pytest

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.engine.grammar import grammar_of

NO_FINITE_VALUE = [
    ({"$ref": "#"}, "'#'"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "'#/$defs/a'"),
    ({"anyOf": [{"$ref": "#"}]}, "'#'"),
    ({"allOf": [{"$ref": "#"}]}, "'#'"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "'#'"),
    ({"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1}, "'#'"),
    ({"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["x"]}, "'#'"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "'#'"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2}, "'#'"),
    ({"type": "array", "items": [{"$ref": "#"}], "minItems": 1}, "'#'"),
    (  # two definitions that need each other
        {
            "$ref": "#/$defs/a",
            "$defs": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1},
            },
        },
        "'#/$defs/a', '#/$defs/b'",
    ),
    ({"$defs": {"x": {"$anchor": "x", "$ref": "#x"}}, "$ref": "#x"}, "'#x'"),
    ({"$id": "https://example.com/s", "$ref": "https://example.com/s"}, "'https://example.com/s'"),
]

FINITE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # {} ends it
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a string, a number... match
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    {  # a tree: the children array may be empty
        "type": "object",
        "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["value", "children"],
    },
    {  # mutual recursion with a way out through the second definition
        "$ref": "#/$defs/a",
        "$defs": {
            "a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "string"}]},
            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1},
        },
    },
    {"$defs": {"a~b": {"type": "string"}}, "$ref": "#/$defs/a~0b"},
    {"$defs": {"a b": {"type": "integer"}}, "$ref": "#/$defs/a%20b"},
]


@pytest.mark.parametrize(("schema", "refs"), NO_FINITE_VALUE)
def test_a_schema_with_no_finite_value_is_an_invalid_request_naming_its_refs(schema, refs):
    with pytest.raises(InvalidRequest) as e:
        grammar_of(json.dumps(schema))
    assert e.value.param == "json_schema"
    assert e.value.message.startswith("the JSON schema describes no finite JSON value")
    assert f"(self-referring $ref: {refs})" in e.value.message


@pytest.mark.parametrize("schema", FINITE)
def test_a_recursive_schema_with_a_way_out_compiles(schema):
    assert '"json_schema"' in grammar_of(json.dumps(schema))


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"$ref": "#/nope"}, "Pointer '/nope' does not exist"),
        ({"$ref": "https://example.com/other"}, "Default retriever does not fetch resources"),
        ({"$ref": "#", "type": "string"}, "circular references with sibling keys are not supported"),
        ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, 'Unimplemented keys: ["if", "then"]'),
        (
            {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "a oneOf whose branches can match the same value is not supported",
        ),
        ({"type": "string", "format": "bogus"}, "Unknown format: bogus"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
    ],
)
def test_unresolvable_refs_and_unsupported_keywords_are_invalid_requests_saying_why(schema, problem):
    with pytest.raises(InvalidRequest) as e:
        grammar_of(json.dumps(schema))
    assert e.value.param == "json_schema"
    assert e.value.message.startswith("the JSON schema cannot be enforced: ")
    assert problem in e.value.message


@pytest.mark.parametrize("depth", [200, 2000, 20000])
def test_a_deeply_nested_schema_is_an_invalid_request_not_a_recursion_error(depth):
    """A gRPC client's json_schema is text the compute instance parses: nesting past Python's recursion limit
    (or llguidance's, which is lower) is a refusal naming json_schema, at any depth."""
    schema = '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
    with pytest.raises(InvalidRequest) as e:
        grammar_of(schema)
    assert e.value.param == "json_schema"


def test_an_overlapping_one_of_is_refused_with_what_the_caller_can_change():
    """llguidance's own advice names an option of its API ('coerce_one_of'); callers get the schema's fix."""
    with pytest.raises(InvalidRequest) as e:
        grammar_of(json.dumps({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}))
    assert "coerce_one_of" not in str(e.value) and "disjoint" in str(e.value) and "anyOf" in str(e.value)
    assert e.value.param == "json_schema"
    disjoint = {"oneOf": [{"const": "a"}, {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]}
    assert grammar_of(json.dumps(disjoint))  # disjoint branches compile
