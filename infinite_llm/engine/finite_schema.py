"""Does a JSON schema describe at least one finite JSON value? (structured output; :mod:`.grammar`'s check)

llguidance compiles a schema whose every value would have to contain itself without end (``{"$ref": "#"}``,
or an object that requires a property of its own type) into a grammar that has no complete sentence: the
matcher either allows nothing but EOS from the first token (an empty, invalid answer) or lets the model nest
``{"a": {"a": ...`` until ``max_tokens``. Either way the request cannot succeed, so it is refused up front.

The test is the grammar's productive-symbols fixpoint (Hopcroft & Ullman, "useless symbols") taken on the
schema: a ``$ref`` target starts out as producing nothing and is promoted once it can produce a value from
what is already known; passes repeat until nothing changes. It follows the keywords that force a value to
contain another (``$ref``, ``allOf``, ``anyOf``, ``oneOf``, ``type``, ``required``, ``minProperties``,
``prefixItems``/``items``, ``minItems``); everything else (contradictory bounds, unsupported keywords,
unresolvable references) is llguidance's to judge. A reference it cannot follow here (another document's
URI) counts as producing a value, so a schema is refused only when it surely has none.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from infinite_llm.core.errors import InvalidRequest

ALL_TYPES = ["null", "boolean", "object", "array", "number", "integer", "string"]


def require_finite_value(schema: Any) -> None:
    """``InvalidRequest`` (param ``json_schema``) naming the self-referring ``$ref``\\ s when no finite JSON
    value matches ``schema`` (a parsed JSON schema)."""
    check = _Finiteness(schema)
    if check.run():
        return
    refs = ", ".join(repr(r) for r in sorted(check.unproductive_refs())) or "none"
    raise InvalidRequest(
        "the JSON schema describes no finite JSON value: every value it allows would contain itself without "
        f"end (self-referring $ref: {refs}); give the recursion a way out (an optional property, an "
        "anyOf branch, an array that may be empty)",
        param="json_schema",
    )


class _Finiteness:
    """One schema's fixpoint: ``known[id(target)]`` says whether a ``$ref`` target produces a value."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.known: dict[int, bool] = {}
        self.ref_targets: dict[str, int] = {}  # each $ref's text -> id of its target, for the error message
        self._done: set[int] = set()  # targets evaluated in this pass
        self._open: set[int] = set()  # targets being evaluated (a cycle reads their current value)
        self._changed = False

    def run(self) -> bool:
        """Whether the root produces a value; passes repeat until no target is promoted (at most one pass
        per target plus one, since a target only ever goes from False to True)."""
        while True:
            self._changed, self._done = False, set()
            result = self.node(self.root, self.root)
            if not self._changed:
                return result

    def unproductive_refs(self) -> set[str]:
        return {ref for ref, key in self.ref_targets.items() if not self.known.get(key, True)}

    def node(self, schema: Any, base: Any) -> bool:
        """Whether ``schema`` produces a value; ``base``: the resource its ``#`` references point into."""
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            return True  # malformed: llguidance says why
        if "$id" in schema:
            base = schema
        ok = self.ref(schema["$ref"], base) if "$ref" in schema else True
        ok = all(self.node(s, base) for s in _list(schema.get("allOf"))) and ok
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                ok = any(self.node(s, base) for s in schema[key]) and ok
        if not ok or "const" in schema or "enum" in schema:
            return ok  # listed values are finite; whether they match the rest is llguidance's check
        types = schema.get("type", ALL_TYPES)
        return any(self.of_type(t, schema, base) for t in ([types] if isinstance(types, str) else _list(types)))

    def ref(self, ref: Any, base: Any) -> bool:
        target = _resolve(ref, base)
        if target is None:
            return True  # not followed here (see the module docstring)
        key = id(target)
        self.ref_targets[ref] = key
        if key in self._open or key in self._done:
            return self.known.get(key, False)
        self._open.add(key)
        produces = self.node(target, base)
        self._open.discard(key)
        self._done.add(key)
        if produces and not self.known.get(key, False):
            self._changed = True
        self.known[key] = self.known.get(key, False) or produces
        return self.known[key]

    def of_type(self, kind: Any, schema: dict, base: Any) -> bool:
        if kind == "object":
            return self.object_value(schema, base)
        if kind == "array":
            return self.array_value(schema, base)
        return True  # null, booleans, numbers and strings contain nothing

    def object_value(self, schema: dict, base: Any) -> bool:
        """Every required property, and enough others for ``minProperties``, must produce a value."""
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        others = schema.get("additionalProperties", True)
        open_names = bool(schema.get("patternProperties"))  # a name it matches is not followed here
        required = {r for r in _list(schema.get("required")) if isinstance(r, str)}
        for name in required:
            if name in props:
                if not self.node(props[name], base):
                    return False
            elif not open_names and not self.node(others, base):
                return False
        if _int(schema.get("minProperties")) <= len(required):
            return True
        optional = [s for name, s in props.items() if name not in required]
        return open_names or any(self.node(s, base) for s in optional) or self.node(others, base)

    def array_value(self, schema: dict, base: Any) -> bool:
        """The first ``minItems`` items must each produce a value (``prefixItems``, else ``items``)."""
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, rest = items, schema.get("additionalItems", True)
        else:
            prefix, rest = _list(schema.get("prefixItems")), items
        needed = _int(schema.get("minItems"))
        return all(self.node(prefix[i] if i < len(prefix) else rest, base) for i in range(min(needed, len(prefix) + 1)))


def _resolve(ref: Any, base: Any) -> Any:
    """The subschema that ``ref`` names within the resource ``base`` (a JSON pointer or an ``$anchor``
    after ``#``, optionally behind ``base``'s own ``$id``), or None."""
    if not isinstance(ref, str):
        return None
    own_id = base.get("$id") if isinstance(base, dict) else None
    uri = own_id.split("#")[0] if isinstance(own_id, str) else ""
    if uri and (ref == uri or ref.startswith(uri + "#")):
        ref = ref[len(uri) :] or "#"
    if not ref.startswith("#"):
        return None  # another document
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return _anchor(base, pointer)
    target = base
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _anchor(schema: Any, name: str) -> Any:
    """The subschema of ``schema`` whose ``$anchor`` is ``name`` (depth first), or None."""
    if isinstance(schema, dict):
        if schema.get("$anchor") == name:
            return schema
        children = schema.values()
    elif isinstance(schema, list):
        children = schema
    else:
        return None
    for child in children:
        if (found := _anchor(child, name)) is not None:
            return found
    return None


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
