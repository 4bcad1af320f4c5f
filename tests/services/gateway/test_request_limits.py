"""Limits the REST gateway checks before a request reaches the mesh: prompt size (before any tokenizing, the
router's ``prompt_limits``), tokenizing off the event loop, the number of choices per request, and the field a
too-large completion length is named by. The real gateway app runs over a real in-process router whose only
compute instance is unreachable, with the real SmolLM2 tokenizer: every case here is decided before a compute
instance would be asked."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from infinite_llm.services.gateway.app import create_app
from infinite_llm.services.gateway.backend import RouterBackend
from infinite_llm.services.prompt_limits import max_text_chars
from tests.services.gateway.conftest import MAX_MODEL_LEN

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()


class GatedTokenizer:
    """The real tokenizer, whose ``encode`` (or ``encode_chat``) of more than ``min_chars`` characters signals
    ``started`` and waits for ``release`` (at most ``wait_s``) before tokenizing; ``finished`` is set once it
    has."""

    def __init__(self, tokenizer, min_chars: int, wait_s: float = 15.0) -> None:  # noqa: ANN001
        self._tokenizer, self._min_chars, self._wait_s = tokenizer, min_chars, wait_s
        self.started, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.calls: list[int] = []  # the length of every text encoded

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._gated(len(text), self._tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:  # noqa: ANN003
        chars = sum(len(m.get("content") or "") for m in messages)
        return self._gated(chars, self._tokenizer.encode_chat, messages, **kwargs)

    def _gated(self, chars: int, fn, *args, **kwargs) -> list[int]:  # noqa: ANN001, ANN002, ANN003
        self.calls.append(chars)
        if chars <= self._min_chars:
            return fn(*args, **kwargs)
        self.started.set()
        self.release.wait(self._wait_s)
        try:
            return fn(*args, **kwargs)
        finally:
            self.finished.set()

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._tokenizer, name)


def _error(r, status: int, param: str | None, code: str | None = None) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "chars"),
    [
        ("/v1/completions", {"prompt": "hello world " * 90000}, "prompt", 1_080_000),
        ("/v1/completions", {"prompt": ["hi", "hello world " * 90000]}, "prompt.1", 1_080_000),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello world " * 50000}] * 2},
            "messages",
            1_200_000,
        ),
    ],
    ids=["prompt", "prompt-list", "chat-messages-in-all"],
)
def test_an_oversized_prompt_is_a_400_at_once_without_tokenizing(router_address, tokenizer, path, body, param, chars):
    gate = GatedTokenizer(tokenizer, min_chars=0)  # any tokenizing would block (and be recorded)
    gate.release.set()
    with TestClient(create_app(RouterBackend(router_address, gate, tls=None))) as c:
        start = time.monotonic()
        r = c.post(path, json={**body, "max_tokens": 2})
        took = time.monotonic() - start
    error = _error(r, 400, param)
    assert error["message"] == (
        f"{param} has {chars} characters, more than any text of the model's maximum length (8192 tokens) can "
        f"have ({max_text_chars(MAX_MODEL_LEN)})"
    )
    assert gate.calls == [] and not gate.started.is_set()  # refused before any tokenizing
    assert took < 5.0, took  # the body is parsed and checked, nothing more


def _tool(description: str) -> dict:
    return {"type": "function", "function": {"name": "f", "description": description}}


@pytest.mark.parametrize(
    ("content", "description", "param", "chars"),
    [
        ("hi", "hello world " * 90000, "tools", 2 + 1_080_062),  # the tools alone are too long
        ("hello world " * 50000, "hello world " * 50000, "tools", 600_000 + 600_062),  # each fits, not both
        ("hello world " * 60000, "hello world " * 40000, "messages", 720_000 + 480_062),
    ],
    ids=["tools-alone", "tools-the-larger-part", "messages-the-larger-part"],
)
@pytest.mark.parametrize("tool_choice", ["none", "required"])
def test_a_chat_whose_messages_and_tools_are_oversized_in_all_is_a_400_without_tokenizing(
    router_address, tokenizer, content, description, param, chars, tool_choice
):
    """The tool definitions reach the prompt (the template's tools, or the system message's listing), so
    their JSON text counts with the messages (compact: 62 characters of the tool here besides its
    description)."""
    gate = GatedTokenizer(tokenizer, min_chars=0)
    gate.release.set()
    body = {"messages": [{"role": "user", "content": content}], "tools": [_tool(description)]}
    with TestClient(create_app(RouterBackend(router_address, gate, tls=None))) as c:
        start = time.monotonic()
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": tool_choice, "max_tokens": 2})
        took = time.monotonic() - start
    error = _error(r, 400, param)
    assert error["message"] == (
        f"messages and tools have {chars} characters, more than any text of the model's maximum length (8192 "
        f"tokens) can have ({max_text_chars(MAX_MODEL_LEN)})"
    )
    assert gate.calls == [] and not gate.started.is_set()
    assert took < 5.0, took


def test_a_chat_with_tools_under_the_limit_goes_to_the_mesh(router_address, tokenizer):
    """Rendered with the tools' listing in a system message (SmolLM2's template does not render tools), then
    sent on: 503, the router's only compute instance is unreachable."""
    gate = GatedTokenizer(tokenizer, min_chars=0)
    gate.release.set()
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [_tool("hello " * 100)]}
    with TestClient(create_app(RouterBackend(router_address, gate, tls=None))) as c:
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert len(gate.calls) == 1 and gate.calls[0] > 600  # "hi" and the tool's listing


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_long_prompt_being_tokenized_stalls_no_other_request(router_address, tokenizer, chat):
    """While a large but allowed prompt is held inside the real tokenizer, ``/health`` and ``/v1/models``
    are answered: tokenizing (and chat-template rendering) runs off the event loop. On the loop, neither
    could be answered before the tokenizer returned, and ``finished`` would be set when they were."""
    big = TEXT * 3  # about 35k characters, about 7.5k tokens: allowed, and it fits the context
    gate = GatedTokenizer(tokenizer, min_chars=len(TEXT))
    body = {"messages": [{"role": "user", "content": big}]} if chat else {"prompt": big}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with TestClient(create_app(RouterBackend(router_address, gate, tls=None))) as c:
        replies = []
        sender = threading.Thread(target=lambda: replies.append(c.post(path, json={**body, "max_tokens": 2})))
        sender.start()
        try:
            assert gate.started.wait(30), "the big prompt was never tokenized"
            health, models = c.get("/health"), c.get("/v1/models")
            assert not gate.finished.is_set()  # both answered while the prompt was still being tokenized
        finally:
            gate.release.set()
            sender.join(60)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["smollm2"]
    # Tokenized in full, then sent to the mesh, whose only compute instance is unreachable: 503.
    assert gate.finished.is_set() and replies[0].status_code == 503, replies[0].text


@pytest.mark.parametrize(
    ("body", "cap", "asked"),
    [
        ({"prompt": ["hi"] * 500}, None, "500 choices (500 prompts x n=1)"),
        ({"prompt": [[1, 2]] * 65, "n": 2}, None, "130 choices (65 prompts x n=2)"),
        ({"prompt": ["hi", "yo"], "n": 5}, 8, "10 choices (2 prompts x n=5)"),
    ],
    ids=["500-prompts", "65-prompts-n2", "2-prompts-n5-over-a-cap-of-8"],
)
def test_more_choices_than_the_cap_is_a_400_naming_the_prompt(router_address, tokenizer, body, cap, asked):
    """None: the default cap, 128 (OpenAI's cap on n alone)."""
    gate = GatedTokenizer(tokenizer, min_chars=0)
    gate.release.set()
    kwargs = {} if cap is None else {"max_choices_per_request": cap}
    with TestClient(create_app(RouterBackend(router_address, gate, tls=None), **kwargs)) as c:
        r = c.post("/v1/completions", json={**body, "max_tokens": 2})
    error = _error(r, 400, "prompt")
    assert error["message"] == f"this request asks for {asked}; this server allows at most {cap or 128} per request"
    assert gate.calls == []  # refused before tokenizing any of them


def test_n_alone_over_a_configured_cap_names_n_and_the_cap_itself_is_served(router_address, tokenizer):
    with TestClient(create_app(RouterBackend(router_address, tokenizer, tls=None), max_choices_per_request=4)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 5})
        _error(r, 400, "n")
        # At the cap the request goes to the mesh (here: its compute instance is unreachable, 503).
        assert c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}).status_code == 503


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completion", "chat"],
)
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_completion_length_past_the_context_names_the_field_sent(router_address, tokenizer, path, body, field):
    with TestClient(create_app(RouterBackend(router_address, tokenizer, tls=None))) as c:
        r = c.post(path, json={**body, field: 9000})
    error = _error(r, 400, field, "context_length_exceeded")
    assert "maximum context length is 8192 tokens" in error["message"]


@pytest.mark.parametrize("ids", [[-3], [2, -1]])
def test_negative_stop_token_ids_are_a_400_naming_them(router_address, tokenizer, ids):
    """Refused by the router's validation of every request (token ids past the vocabulary are refused by the
    compute instance: ``tests/e2e``)."""
    with TestClient(create_app(RouterBackend(router_address, tokenizer, tls=None))) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids})
    error = _error(r, 400, "stop_token_ids")
    assert error["message"] == f"stop_token_ids must be token ids >= 0, got {min(ids)}"
