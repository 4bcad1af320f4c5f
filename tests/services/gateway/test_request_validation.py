"""How the gateway refuses a malformed body, and in what order: the API key is checked before the body is
read (a caller without the key learns 401, never whether its JSON parsed), types are strict as OpenAI's
(``"max_tokens": "8"`` is a 400, not 8 tokens), and each 400 names the parameter at fault with what it
expected and what it got, never pydantic's internals (``prompt.str``). A body that passes goes to the
router, whose only compute instance is unreachable: 503."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from infinite_llm.core.sampling import MAX_STOP_STRINGS
from infinite_llm.services.gateway.app import create_app
from infinite_llm.services.gateway.backend import RouterBackend

KEY = "s3cret"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(router_address, tokenizer):
    with TestClient(create_app(RouterBackend(router_address, tokenizer, tls=None), api_key=KEY)) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def _bad(r, param: str | None, message: str) -> None:  # noqa: ANN001
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


@pytest.mark.parametrize("authorization", [None, "Bearer wrong"], ids=["no-key", "wrong-key"])
@pytest.mark.parametrize("body", [b'{"prompt":', b"", b'{"prompt": 5}'], ids=["not-json", "empty", "bad-type"])
def test_the_api_key_is_checked_before_the_body(client, authorization, body):
    headers = {"Content-Type": "application/json", "Authorization": authorization or ""}
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == (None if authorization is None else "invalid_api_key")


def test_with_the_key_a_malformed_body_is_a_400_and_a_good_one_reaches_the_router(client):
    r = client.post("/v1/completions", content=b'{"prompt":', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON: "), r.text
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503, r.text  # the router's only compute instance is unreachable


INT, BOOL, NUMBER = (
    "Input should be a valid integer",
    "Input should be a valid boolean",
    "Input should be a valid number",
)


@pytest.mark.parametrize(
    ("chat", "field", "value", "message"),
    [
        (False, "max_tokens", "8", f"{INT}, got a string"),
        (False, "max_tokens", True, f"{INT}, got a boolean"),
        (False, "max_tokens", 2.5, f"{INT}, got a number"),
        (False, "stream", "yes", f"{BOOL}, got a string"),
        (False, "temperature", "0.5", f"{NUMBER}, got a string"),
        (False, "temperature", 3, "Input should be less than or equal to 2, got 3"),
        (True, "n", "2", f"{INT}, got a string"),
        (True, "logprobs", 1, f"{BOOL}, got an integer"),
    ],
)
def test_types_are_strict_as_openai(client, chat, field, value, message):
    body = {"messages": USER} if chat else {"prompt": "hi"}
    r = client.post("/v1/chat/completions" if chat else "/v1/completions", json={**body, field: value})
    _bad(r, field, f"{field}: {message}")


def test_a_number_must_be_finite(client):
    json = {"Content-Type": "application/json"}
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}', headers=json)
    _bad(r, "temperature", "temperature: Input should be a finite number, got nan")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"prompt": 5},
            "prompt",
            "prompt: expected a string, an array of strings, an array of token ids or an array of arrays of token "
            "ids, got an integer",
        ),
        (
            {"prompt": {"text": "hi"}},
            "prompt",
            "prompt: expected a string, an array of strings, an array of token ids or an array of arrays of token "
            "ids, got an object",
        ),
    ],
)
def test_a_value_no_member_of_a_union_takes_is_one_problem_named_by_its_field(client, body, param, message):
    _bad(client.post("/v1/completions", json=body), param, message)


def test_chat_content(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 7}]})
    _bad(r, "messages.0.content", "messages.0.content: expected a string or an array of content parts, got an integer")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]})
    _bad(
        r, "messages.0", "messages.0: Value error, a user message needs content (a string or an array of content parts)"
    )
    # An assistant's message may go without content (it carries tool calls): this one passes validation.
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": []}, *USER]
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).status_code == 503


def test_a_missing_body_or_one_that_is_not_an_object(client):
    _bad(
        client.post("/v1/completions"),
        None,
        "the request body is missing: send a JSON object (Content-Type: application/json)",
    )
    _bad(client.post("/v1/completions", json=["hi"]), None, "the request body must be a JSON object, got an array")
    for content_type in ("text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = client.post("/v1/completions", content=b"hello", headers=headers)
        told = f"Content-Type {content_type or 'not given'}; send application/json"
        _bad(r, None, f"the request body must be a JSON object, got bytes ({told})")


def test_several_problems_count_the_others(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": "8", "n": "2"})
    _bad(r, "max_tokens", "max_tokens: Input should be a valid integer, got a string (and 1 more problem)")


def test_too_many_stop_strings_is_a_400_naming_stop(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "stop": ["x"] * 100_000})
    _bad(r, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got 100000")


def test_a_huge_bad_value_is_quoted_short(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "x" * 1_000_000, "content": "hi"}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("messages.0"), error
    assert "xxxxx" in error["message"] and len(error["message"]) < 400, error["message"]
