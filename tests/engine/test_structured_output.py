"""Structured output in the engine: every constrained output parses and validates against its schema, in
one batch beside an unconstrained request whose tokens stay exactly what they are alone."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from infinite_llm.core.constraints import ComputeOnWait
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine.structured import GrammarCompiler, GuidanceMaskPrefetch, mask_prefetch_for

SCHEMAS = [
    {"type": "object"},
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}},
        "required": ["values"],
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16}},
                "required": ["name"],
            },
        },
        "required": ["ok", "city"],
    },
]
ASK = "Describe a person who lives in Paris as a JSON object."


def test_every_constrained_output_parses_and_validates_and_the_unconstrained_one_is_unchanged(make_engine):
    engine = make_engine(block_size=16, num_kv_blocks=256)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": ASK}])
    plain = SamplingParams(max_tokens=24, temperature=0)
    (alone,) = engine.generate([prompt], plain)
    constrained = [
        SamplingParams(max_tokens=96, temperature=temperature, seed=3, json_schema=json.dumps(schema))
        for schema in SCHEMAS
        for temperature in (0.0, 0.7)
    ]
    outs = engine.generate([prompt] * (len(constrained) + 1), [plain, *constrained])
    assert outs[0].token_ids == alone.token_ids
    for params, out in zip(constrained, outs[1:], strict=True):
        assert out.finish_reason == "stop", out.text  # EOS once the value is complete
        jsonschema.validate(json.loads(out.text), json.loads(params.json_schema))
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


@pytest.mark.parametrize(
    "schema",
    ["{not json", "[1, 2]", json.dumps({"type": "object", "minProperties": "x"}), json.dumps({"$ref": "#"})],
)
def test_a_schema_that_cannot_be_enforced_is_an_invalid_request(make_engine, schema):
    engine = make_engine(block_size=16, num_kv_blocks=32)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("hi", SamplingParams(json_schema=schema))
    assert e.value.param == "json_schema"
    assert not engine.has_unfinished()


def test_a_grammar_that_can_begin_no_value_is_refused_before_it_samples(make_engine, monkeypatch):
    """Behind the finite-value check (off here): llguidance's matcher for ``{"$ref": "#"}`` fails on its
    first mask, which would leave only EOS, an empty answer; the engine refuses the request instead."""
    monkeypatch.setattr("infinite_llm.engine.grammar.require_finite_value", lambda schema: None)
    engine = make_engine(block_size=16, num_kv_blocks=32)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("hi", SamplingParams(json_schema=json.dumps({"$ref": "#"})))
    assert e.value.param == "json_schema"
    assert e.value.message.startswith("the JSON schema cannot be enforced: no value it allows can begin")
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


@pytest.mark.parametrize("overlap", [True, False])
def test_masks_from_the_parallel_executor_equal_those_computed_one_by_one(default_weights, overlap):
    """The engine's prefetch (llguidance's parallel executor, on a worker thread during the forward or right
    after it) gives the same masks as filling each row alone on the engine's thread, for llguidance
    constraints part-way through a value; a step without constrained sequences starts no thread."""
    model_config, _, tokenizer = default_weights
    prefetch = GuidanceMaskPrefetch(overlap=overlap, num_threads=2)
    assert prefetch.start([None, None], 8)() is None and prefetch._pool is None
    grammars, schema = GrammarCompiler(tokenizer, model_config.vocab_size), json.dumps(SCHEMAS[1])
    constraints = [grammars.constraint(schema) for _ in range(3)]
    for token in tokenizer.encode('{"name":"Ann', add_special_tokens=False):
        constraints[1].accept(token)
    rows = [constraints[0], None, constraints[1], constraints[2]]
    batched = prefetch.start(rows, model_config.vocab_size)()
    assert (prefetch._pool is not None) == overlap
    one_by_one = ComputeOnWait().start(rows, model_config.vocab_size)()
    assert batched.rows == one_by_one.rows == [0, 2, 3] and torch.equal(batched.bitmask, one_by_one.bitmask)
    assert torch.equal(batched.bitmask[0], batched.bitmask[2])
    assert not torch.equal(batched.bitmask[0], batched.bitmask[1])  # a fresh value vs one inside a string


def test_the_masks_overlap_the_forward_except_on_a_cpu_with_local_kv():
    assert not mask_prefetch_for("cpu", remote_kv=False).overlap
    assert mask_prefetch_for("cpu", remote_kv=True).overlap  # the forward waits on attention servers
    assert mask_prefetch_for("cuda:0", remote_kv=False).overlap
