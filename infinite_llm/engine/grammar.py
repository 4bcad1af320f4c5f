"""A JSON schema -> the llguidance grammar that enforces it (structured output, issue 12).

No torch: the gateway checks a request's schema with it before any compute instance sees the request; the
engine (:mod:`.structured`) builds its per-request token constraints from the same grammar. JSON is compact
(``whitespace_flexible: false``): a small model left free to emit whitespace can spin on it until
``max_tokens`` and never close the object.
"""

from __future__ import annotations

import json

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.engine.finite_schema import require_finite_value

JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_of(json_schema: str) -> str:
    """The llguidance grammar of ``json_schema`` (JSON text); ``InvalidRequest`` when it is not a schema
    llguidance can enforce (bad JSON, an unsupported keyword, a reference it cannot resolve) or one that no
    finite JSON value matches (``{"$ref": "#"}``: :mod:`.finite_schema`), naming ``json_schema``."""
    import llguidance

    try:
        schema = json.loads(json_schema)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the JSON schema is not valid JSON: {e}", param="json_schema") from None
    except RecursionError:  # nested past Python's recursion limit (llguidance refuses far less depth anyway)
        raise InvalidRequest("the JSON schema nests too deeply to be enforced", param="json_schema") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequest("a JSON schema is an object (or true/false)", param="json_schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
    except ValueError as e:
        raise InvalidRequest(f"the JSON schema cannot be enforced: {_explained(str(e))}", param="json_schema") from None
    is_error, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        problem = _explained("; ".join(problems))
        raise InvalidRequest(f"the JSON schema cannot be enforced: {problem}", param="json_schema")
    require_finite_value(schema)
    return grammar


def _explained(problem: str) -> str:
    """llguidance's ``problem``, with its advice to set one of its own options (which an API caller cannot)
    replaced by what the caller can change in the schema."""
    if "coerce_one_of" in problem:
        return (
            "a oneOf whose branches can match the same value is not supported (exactly one may match, which "
            "generation cannot check): make the branches disjoint (a const discriminator property, as pydantic's "
            "discriminated unions have) or use anyOf"
        )
    return problem
