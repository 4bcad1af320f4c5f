"""Tool calls (OpenAI ``tools`` + ``tool_choice``): the prompt, the output constraint, and the parsed calls.

- ``required`` and a named function are enforced by structured output (``engine/structured.py``), so they
  work with any model: a named function's output is its ``arguments`` object (the function's JSON schema);
  ``required`` is a JSON array of ``{"name", "parameters"}`` items, one schema per function (vLLM's form).
- ``auto`` needs the model family's own tool-call format: templates that render ``tools`` and write
  ``<tool_call>{"name", "arguments"}</tool_call>`` (Hermes, Qwen 2.5) are parsed; any other model is a 400.
- ``none``: the tools are shown to the model and the answer is plain text.
History: a template that renders ``tools`` gets them, and assistant ``tool_calls`` with ``arguments`` as
objects (as HF templates expect, and vLLM passes them). A template that does not (SmolLM2's) gets the tool
list in the system message and each assistant call as the JSON it would have written, so no turn is lost.
Source: OpenAI's function-calling guide; vLLM ``entrypoints/openai/serving_chat.py`` and its Hermes parser.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.engine.grammar import grammar_of

HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the generation: ``mode`` is none/auto/required/named."""

    mode: str
    functions: dict[str, dict]  # name -> {"name", "description", "parameters"}
    name: str | None = None  # the named function
    json_schema: str | None = None  # the output constraint (required, named)

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


def tool_plan(tools: list[Any] | None, tool_choice: Any, tokenizer) -> ToolPlan | None:  # noqa: ANN001
    """Validate ``tools``/``tool_choice`` and say how to honour them; None without tools. 400s name the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs a non-empty tools list", param="tool_choice")
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto", "required"):
        if choice == "auto" and "<tool_call>" not in str(getattr(tokenizer.hf, "chat_template", "") or ""):
            raise InvalidRequest(
                "tool_choice 'auto' needs a model whose chat template defines a tool-call format, and this "
                "model's does not; use tool_choice 'required' or name a function (both are enforced by a grammar)",
                param="tool_choice",
            )
        if choice == "required":
            _check_parameters(functions, list(functions))
        schema = _required_schema(functions) if choice == "required" else None
        return ToolPlan(choice, functions, json_schema=schema)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name not in functions:
        raise InvalidRequest(
            f"tool_choice must be none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}} "
            f"naming one of the tools {sorted(functions)}; got {choice!r}",
            param="tool_choice",
        )
    _check_parameters(functions, [name])
    return ToolPlan("named", functions, name, json.dumps(functions[name]["parameters"]))


def _functions(tools: list[Any]) -> dict[str, dict]:
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest("each tool is {'type': 'function', 'function': {'name': ...}}", param=f"tools.{i}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        out[fn["name"]] = {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}
    return out


def _check_parameters(functions: dict[str, dict], names: list[str]) -> None:
    """400 naming ``tools.i.function.parameters`` when a schema the output must follow cannot be enforced
    (the check ``response_format`` gets), before the mesh sees the request."""
    for i, (name, fn) in enumerate(functions.items()):
        if name in names:
            try:
                grammar_of(json.dumps(fn["parameters"]))
            except InvalidRequest as e:
                raise InvalidRequest(e.message, param=f"tools.{i}.function.parameters") from None


def _required_schema(functions: dict[str, dict]) -> str:
    """One array item per function; each function's parameters keep their own ``$ref`` root (``#`` and
    ``#/$defs/...`` inside them mean the parameters, not the array) through an ``$id`` of their own."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "parameters": _own_resource(fn["parameters"], i)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, (name, fn) in enumerate(functions.items())
    ]
    return json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": items}})


def _own_resource(schema: Any, i: int) -> Any:
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    return {"$id": f"urn:infinite-llm:tool-parameters:{i}", **schema}


# ---- the prompt -------------------------------------------------------------------------------------------
def render_history(messages: list[dict], plan: ToolPlan | None, tokenizer) -> tuple[list[dict], list[dict] | None]:  # noqa: ANN001
    """``(messages for the template, tools for the template)``; see the module docstring."""
    native = tokenizer.template_renders_tools
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            parsed = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls]
            if native:
                m = {**m, "tool_calls": [{**c, "function": p} for c, p in zip(calls, parsed, strict=True)]}
            else:  # written as the model writes calls under ``required``
                written = [{"name": p["name"], "parameters": p["arguments"]} for p in parsed]
                m = {"role": m["role"], "content": (m.get("content") or "") + json.dumps(written)}
        out.append(m)
    if plan is None or native:
        return out, ([{"type": "function", "function": f} for f in plan.functions.values()] if plan else None)
    listing = "You can call these functions (JSON schemas of their parameters):\n" + json.dumps(
        list(plan.functions.values())
    )
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{listing}"}, *out[1:]], None
    return [{"role": "system", "content": listing}, *out], None


def _arguments(call: dict) -> Any:
    """A history call's ``arguments`` (a JSON string in OpenAI's shape) as an object."""
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise InvalidRequest("an assistant tool call's arguments are not valid JSON", param="messages") from None


# ---- the answer -------------------------------------------------------------------------------------------
def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls in OpenAI's shape)`` of a finished answer; no calls when none parse.

    Under ``required`` and a named function the grammar makes the whole answer calls, so an answer cut short
    (``max_tokens``) is still calls: the complete ones, then the last with the ``arguments`` text it got to,
    as OpenAI and vLLM return a named call cut by ``length``.
    """
    if plan.mode == "named":
        return None, [tool_call(plan.name, text)]
    if plan.mode == "required":
        return _required_calls(text)
    if plan.mode == "auto":
        calls = [call for found in HERMES_CALL.findall(text) if (call := _hermes_call(found)) is not None]
        content = HERMES_CALL.sub("", text).strip() if calls else text
        return content or None, calls
    return text, []


def _hermes_call(body: str) -> dict | None:
    """The call a Hermes ``<tool_call>`` tag's JSON body writes, in OpenAI's shape; None if it is not one.
    Its ``arguments`` are the model's own text of the value when the name comes first (what
    :class:`HermesCallStream` streams), else the value re-serialized."""
    try:
        call = json.loads(body)
        name, arguments = call["name"], json.dumps(call.get("arguments", {}))
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    head = _HERMES_HEAD.match(body)
    if head is not None:
        with contextlib.suppress(json.JSONDecodeError):
            arguments = body[head.end() : json.JSONDecoder().raw_decode(body, head.end())[1]]
    return tool_call(name, arguments)


_ITEM_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')
_ITEM_CLOSE = re.compile(r"\s*\}")  # an item's closing brace, after its parameters


def _required_calls(text: str) -> tuple[str | None, list[dict]]:
    """The calls of a ``required`` answer, a JSON array of ``{"name", "parameters"}``: each item's name with
    the model's own text of its parameters (what :class:`RequiredCallStream` streams, so a streamed answer's
    pieces join into the same ``arguments``), then an item cut short with its name and the parameters' text
    so far. An answer cut before any item's name is whole (``[{"na``) is neither calls nor content: the
    grammar's JSON is never the message's text. Items whose name does not come first (a grammar that
    reordered them) are read as whole JSON; text that is not an array of calls (a grammar would not let it
    be) stays content."""
    start = text.find("[")
    if start < 0 or text[:start].strip():
        return text, []
    calls, at, decoder = [], start + 1, json.JSONDecoder()
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        head = _ITEM_HEAD.match(text, at)
        if head is None:
            break
        name = json.loads(f'"{head.group(1)}"')
        try:
            _, end = decoder.raw_decode(text, head.end())
        except json.JSONDecodeError:  # cut short: the parameters' text so far
            calls.append(tool_call(name, text[head.end() :]))
            return None, calls
        calls.append(tool_call(name, text[head.end() : end]))
        close = _ITEM_CLOSE.match(text, end)
        if close is None:
            break
        at = close.end()
    if calls:
        return None, calls
    try:
        items = json.loads(text)
    except json.JSONDecodeError:  # cut before any item's name was whole: no call yet (and no content)
        return None, []
    try:  # items whose name does not come first
        return None, [tool_call(i["name"], json.dumps(i["parameters"])) for i in items]
    except (KeyError, TypeError):
        return text, []


def tool_call(name: str, arguments: str) -> dict:
    """A call in OpenAI's shape, with a new id (``call_`` and 24 hex digits)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class _CallStream:
    """What the streamed-call parsers share: the answer so far, the calls whose head was sent, and the
    current call's ``arguments`` (a JSON value starting at ``_value``, sent up to ``_sent``).

    An object, array or string value is decoded only once its brackets balance (or its quote closes): a
    scan of each new piece, in which strings and escapes hide brackets, finds that point. Decoding the value
    after every piece would read its text again each time: quadratic in the arguments' length.
    """

    def __init__(self) -> None:
        self.text = ""
        self.calls = 0  # calls whose head was sent
        self._value = 0  # where the current call's arguments start
        self._sent = 0  # ... and how far they were sent
        self._scan = (0, 0, False, False)  # the value's scan: (scanned up to, depth, in a string, after a \)

    def _head(self, name: str, at: int) -> dict:
        """The delta that opens a call (its index, a new id, ``name``); its arguments start at ``at``."""
        self.calls += 1
        self._value = self._sent = at
        self._scan = (at, 0, False, False)
        return {"index": self.calls - 1, **tool_call(json.loads(f'"{name}"'), "")}

    def _may_be_whole(self) -> bool:
        """Whether the value starting at ``_value`` may have ended in the text so far: a scalar always may
        (it is short); an object, array or string once its brackets balance or its quote closes."""
        text = self.text
        if self._value >= len(text) or text[self._value] not in '{["':
            return True
        at, depth, in_string, escaped = self._scan
        at = max(at, self._value)
        balanced = False
        while at < len(text) and not balanced:
            c = text[at]
            at += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string, balanced = False, depth == 0
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                balanced = depth == 0
        self._scan = (at, depth, in_string, escaped)
        return balanced

    def _arguments(self, out: list[dict], limit: int | None = None) -> int | None:
        """Append the current call's arguments text that arrived (not past ``limit``) to ``out``; returns
        where the value ends once it is whole (a number at the very end of the text may still grow)."""
        while self._sent == self._value < len(self.text) and self.text[self._value].isspace():
            self._value = self._sent = self._value + 1  # whitespace before the value is not its text
        end, whole = len(self.text), None  # an unfinished value: all of the text so far is its text
        if self._may_be_whole():
            try:
                value, end = json.JSONDecoder().raw_decode(self.text, self._value)
                growing = isinstance(value, int | float) and not isinstance(value, bool) and end == len(self.text)
                whole = end if not growing else None
            except json.JSONDecodeError:
                end = len(self.text)
        end = end if limit is None else min(end, limit)
        if end > self._sent:
            out.append({"index": self.calls - 1, "function": {"arguments": self.text[self._sent : end]}})
            self._sent = end
        return whole


class RequiredCallStream(_CallStream):
    """The calls of a streamed ``required`` answer (a JSON array of ``{"name", "parameters"}``), as OpenAI
    streams calls: for each item, a delta with its ``index``, a new id and its name as soon as the name is
    whole, then its ``arguments`` text piece by piece as the parameters' JSON arrives (the model's own text,
    up to the value's end: never the item's closing brace). :meth:`feed` takes each piece of the answer and
    returns the deltas it completes. Items whose name does not come first (a grammar that reordered them)
    stream nothing: :attr:`calls` stays 0 and the caller parses the whole answer at the end.
    """

    def __init__(self) -> None:
        super().__init__()
        self._at: int | None = None  # where the next item may start (after '[')
        self._in_item = False

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        out: list[dict] = []
        while True:
            if not self._in_item:
                head = self._next_head()
                if head is None:
                    return out
                out.append(self._head(head.group(1), head.end()))
                self._in_item = True
            end = self._arguments(out)
            if end is None:
                return out
            self._at, self._in_item = end, False

    def _next_head(self) -> re.Match | None:
        if self._at is None:
            start = self.text.find("[")
            if start < 0 or self.text[:start].strip():
                return None
            self._at = start + 1
        while self._at < len(self.text) and self.text[self._at] in " \t\r\n,}":
            self._at += 1
        return _ITEM_HEAD.match(self.text, self._at)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesCallStream(_CallStream):
    """A streamed ``auto`` answer in the Hermes format: text, and calls written as ``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>``. :meth:`feed` returns ``(content, deltas)``: the text outside the tags
    as it arrives (a tail that may open a tag, and whitespace until other text follows it, are held back: the
    whole parse strips the content's ends), and each call as :class:`RequiredCallStream` sends them. A call
    whose JSON does not start with its name is sent whole once its tag closes; one that does not parse is
    dropped, as the whole parse drops it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0  # the text before this is handled
        self._state = "content"  # content | head | arguments | close
        self._blank = ""  # whitespace held back until other text follows it

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        content: list[str] = []
        out: list[dict] = []
        while self._step(content, out):
            pass
        return "".join(content), out

    def _step(self, content: list[str], out: list[dict]) -> bool:
        """Advance through the text once; False when it must wait for more."""
        text = self.text
        if self._state == "content":
            at = text.find(_HERMES_OPEN, self._pos)
            end = at if at >= 0 else len(text) - _open_prefix(text, self._pos)
            piece, self._pos = self._blank + text[self._pos : end], end
            sent = piece.rstrip()
            self._blank = piece[len(sent) :]
            content.append(sent)
            if at < 0:
                return False
            self._pos, self._state = at + len(_HERMES_OPEN), "head"
            return True
        close = text.find(_HERMES_CLOSE, self._pos)
        if self._state == "head":
            head = _HERMES_HEAD.match(text, self._pos)
            if head is not None and (close < 0 or head.end() <= close):
                out.append(self._head(head.group(1), head.end()))
                self._state = "arguments"
                return True
            if close < 0:
                return False
            out.extend(self._whole_call(text[self._pos : close]))
            self._pos, self._state = close + len(_HERMES_CLOSE), "content"
            return True
        if self._state == "arguments":
            end = self._arguments(out, limit=close if close >= 0 else None)
            if end is None and close < 0:
                return False
            self._pos, self._state = (end, "close") if end is not None else (close, "close")
            return True
        if close < 0:  # "close": the arguments are whole, the tag's end is still to come
            return False
        self._pos, self._state = close + len(_HERMES_CLOSE), "content"
        return True

    def flush(self) -> str:
        """At the answer's end: the content still held back (as the whole parse keeps it: an unclosed tag is
        text, and only an answer with calls has its ends stripped)."""
        tail = {"content": "", "head": _HERMES_OPEN}.get(self._state)
        if tail is None:  # an unclosed call whose head was sent: it stays a call (cut by max_tokens)
            return ""
        rest = self._blank + tail + self.text[self._pos :]
        return rest.rstrip() if self.calls else rest

    def _whole_call(self, body: str) -> list[dict]:
        """A call whose name is not first, read whole as :func:`parse_calls` reads it (nothing if it cannot)."""
        call = _hermes_call(body)
        if call is None:
            return []
        self.calls += 1
        return [{"index": self.calls - 1, **call}]


def _open_prefix(text: str, start: int) -> int:
    """Length of the longest end of ``text[start:]`` that could begin ``<tool_call>`` (held back)."""
    for n in range(min(len(_HERMES_OPEN) - 1, len(text) - start), 0, -1):
        if _HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0
