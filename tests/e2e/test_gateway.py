"""The OpenAI-compatible REST gateway of a real mesh, driven by the official ``openai`` package.

Greedy output equals the SDK's on the router for the same prompt (chat: the same template, tokenized the
same way); streams end in ``data: [DONE]`` and carry usage on request; every error is an OpenAI error
object with the right status, and the next request still works; a client that leaves mid-stream (or
mid-request) frees every rBlock in the mesh.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from infinite_llm.client import Client, InvalidRequest
from infinite_llm.core.errors import ContextLengthExceeded, KVCapacityExceeded, ModelNotFound
from infinite_llm.models.registry import DEFAULT_MODEL
from infinite_llm.services.admin import cluster_state
from infinite_llm.services.gateway.app import create_app
from infinite_llm.services.gateway.backend import RouterBackend
from infinite_llm.state.etcd_launcher import free_port
from tests.e2e.conftest import API_KEY, BLOCK_SIZE, BLOCKS_PER_SERVER, all_blocks_free, wait_until

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is a KV cache? Answer in one sentence."}]


@pytest.fixture(scope="module")
def sdk(mesh):
    with Client(mesh.router_address) as c:
        yield c


def _ids(tokenizer, n: int) -> list[int]:
    return tokenizer.encode(TEXT)[:n]


# ---- same text as the SDK ------------------------------------------------------------------------------
def test_completion_equals_the_sdk_greedy_text_with_usage(oai, sdk):
    out = oai.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = sdk.generate(PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == DEFAULT_MODEL
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, ref.text, ref.finish_reason)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        ref.prompt_tokens,
        ref.completion_tokens,
        ref.prompt_tokens + ref.completion_tokens,
    )


def test_completion_default_max_tokens_is_16(oai, greedy_16):
    out = oai.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (greedy_16, "length")
    assert out.usage.completion_tokens == 16


def test_chat_equals_the_sdk_on_the_same_template(oai, sdk, tokenizer):
    out = oai.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    ids = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    ref = sdk.generate(ids, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (ref.text, ref.finish_reason)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), ref.completion_tokens)


def test_streamed_chat_adds_up_to_the_sdk_text_and_ends_with_usage(oai, sdk, tokenizer):
    chunks = list(
        oai.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    ids = tokenizer.encode_chat(QUESTION)
    ref = sdk.generate(ids, max_tokens=12, temperature=0)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ref.text
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), ref.completion_tokens)


def test_streamed_completion_is_server_sent_events_ending_in_done(http, sdk):
    body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    ref = sdk.generate(PROMPT, max_tokens=10, temperature=0)
    assert "".join(e["choices"][0]["text"] for e in events) == ref.text
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"] is None


def test_n2_with_a_seed_gives_choice_i_the_seed_plus_i(oai, sdk):
    out = oai.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    refs = [sdk.generate(PROMPT, max_tokens=8, temperature=1.0, seed=7 + i) for i in range(2)]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.prompt_tokens == refs[0].prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == sum(r.completion_tokens for r in refs)


def test_a_list_of_prompts_gives_one_choice_each(oai, sdk):
    out = oai.completions.create(model=DEFAULT_MODEL, prompt=["Hello", "Bonjour"], max_tokens=4, temperature=0)
    assert [c.text for c in out.choices] == [
        sdk.generate(p, max_tokens=4, temperature=0).text for p in ("Hello", "Bonjour")
    ]


@pytest.fixture(scope="module")
def greedy_16(sdk) -> str:
    return sdk.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True).text


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_string_cuts_the_text_before_it(oai, greedy_16, as_list):
    full = greedy_16
    stop = full[6:10]
    assert stop.strip(), f"pick another stop window of {full!r}"
    out = oai.completions.create(
        model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop] if as_list else stop
    )
    assert (out.choices[0].text, out.choices[0].finish_reason) == (full[: full.index(stop)], "stop")


def test_models_and_health(oai, http):
    [card] = oai.models.list().data
    assert (card.id, card.object, card.owned_by) == (DEFAULT_MODEL, "model", "infinite-llm")
    assert card.model_extra["max_model_len"] == 8192
    assert http.get("/health").json() == {"status": "ok"}


# ---- errors ----------------------------------------------------------------------------------------------
def _valid(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path,body,status,kind,param,code",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "invalid_request_error", "temperature", None),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "invalid_request_error", "n", None),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "invalid_request_error", "top_p", None),
        ("/v1/completions", {"max_tokens": 2}, 400, "invalid_request_error", "prompt", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens", None),
        ("/v1/chat/completions", {"messages": []}, 400, "invalid_request_error", "messages", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "hi"}]},
            400,
            "invalid_request_error",
            "messages.0.role",
            None,
        ),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "invalid_request_error", "logprobs", None),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "top_logprobs": 2},
            400,
            "invalid_request_error",
            "top_logprobs",
            None,
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "invalid_request_error",
            "stream_options",
            None,
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "model": "gpt-17"},
            404,
            "invalid_request_error",
            "model",
            "model_not_found",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 9000},
            400,
            "invalid_request_error",
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "invalid_request_error",
            "messages",
            "context_length_exceeded",
        ),
        # Raised in the mesh: the param crosses gRPC with the error's class (it was lost before, None).
        (
            "/v1/completions",
            {"prompt": "hi", "stop": [""], "max_tokens": 2},
            400,
            "invalid_request_error",
            "stop",
            None,
        ),
        ("/v1/completions", {"prompt": [1, 2, 10**6], "max_tokens": 2}, 400, "invalid_request_error", "prompt", None),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_gateway_keeps_serving(http, path, body, status, kind, param, code):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (kind, param, code)
    assert error["message"]
    _valid(http)


def test_malformed_json_is_a_400(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] is None  # not the character offset FastAPI puts in the location
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON")
    _valid(http)


def test_openai_client_raises_its_typed_errors(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_completion_tokens=9000)
    assert e.value.code == "context_length_exceeded"
    assert oai.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_request_larger_than_the_cluster_kv_memory_is_a_non_retryable_400(http, tokenizer, mesh, stream):
    ids = _ids(tokenizer, 3 * BLOCKS_PER_SERVER * BLOCK_SIZE)  # alone it fills every rBlock of the mesh
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "stream": stream})
    assert r.status_code == 400, r.text  # retrying can never help: not a 429
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        "prompt",
    )
    assert "rBlocks" in error["message"] and "never fit" in error["message"]
    _valid(http)
    assert wait_until(lambda: all_blocks_free(mesh))


def test_a_chat_without_max_tokens_is_served_to_the_end_of_kv_memory_not_refused(http, tokenizer, mesh):
    """The chat default (min(512, room in the context)) is not the user's: a chat that fits the cluster's
    KV memory is served, ending where KV memory ends (``length``); an explicit max_tokens that cannot fit is
    still the clear 400 naming it."""
    kv_tokens = 3 * BLOCKS_PER_SERVER * BLOCK_SIZE  # 384: far below the default 512 new tokens
    messages = [{"role": "user", "content": TEXT[:1500]}]  # 328 tokens: 56 to generate, not 146
    prompt_tokens = len(tokenizer.encode_chat(messages))
    assert 200 < prompt_tokens < kv_tokens - 16
    body = {"messages": messages, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": kv_tokens - prompt_tokens,
        "total_tokens": kv_tokens,
    }
    r = http.post("/v1/chat/completions", json={**body, "max_completion_tokens": 512})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        "max_completion_tokens",  # the field it sent, as for the model's context length
    )
    assert error["message"].endswith(f"max_completion_tokens <= {kv_tokens - prompt_tokens} would fit")
    assert wait_until(lambda: all_blocks_free(mesh))


def test_router_errors_reach_the_gateway_as_their_exact_class_and_param(sdk, tokenizer):
    """What the gateway receives through the SDK: the class (so the HTTP status and OpenAI type/code) and the
    param the mesh raised, read from the status's reason, not from its message."""
    with pytest.raises(ContextLengthExceeded) as e:
        sdk.generate("hi", max_tokens=9000)
    assert (e.value.param, e.value.http_status, e.value.openai_code) == ("max_tokens", 400, "context_length_exceeded")
    with pytest.raises(ModelNotFound) as e:
        sdk.generate("hi", max_tokens=2, model="gpt-17")
    assert (e.value.param, e.value.http_status, e.value.openai_code) == ("model", 404, "model_not_found")
    with pytest.raises(KVCapacityExceeded) as e:
        sdk.generate(_ids(tokenizer, 3 * BLOCKS_PER_SERVER * BLOCK_SIZE), max_tokens=8)
    assert (e.value.param, e.value.http_status, e.value.openai_code) == ("prompt", 400, "context_length_exceeded")
    with pytest.raises(InvalidRequest) as e:
        sdk.generate("hi", max_tokens=2, top_p=1.5)
    assert type(e.value) is InvalidRequest and e.value.http_status == 400


# ---- gateways built in-process: no router, an API key ---------------------------------------------------
def test_unreachable_router_is_503_with_an_openai_error(tokenizer):
    app = create_app(RouterBackend(f"127.0.0.1:{free_port()}", tokenizer))
    with TestClient(app) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "unavailable" in r.json()["error"]["message"]


def test_api_key_is_required_when_configured(mesh, tokenizer):
    app = create_app(RouterBackend(mesh.router_address, tokenizer), api_key="s3cret")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
        assert {k: v for k, v in r.json()["error"].items() if k != "message"} == {
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200  # probes need no key
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=c, max_retries=0)
        assert client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=c, max_retries=0).models.list()


# ---- leaving early frees the mesh ------------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_every_block_and_the_ledger(oai, tokenizer, mesh):
    stream = oai.completions.create(
        model=DEFAULT_MODEL,
        prompt=_ids(tokenizer, 150),
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(stream)
    next(stream)
    state = cluster_state(mesh.manager_address)
    assert len(state.ledger) == 1 and sum(s.num_blocks for s in state.ledger[0].shares) >= 10
    stream.close()  # the client goes away
    assert wait_until(lambda: all_blocks_free(mesh))
    assert wait_until(lambda: len(cluster_state(mesh.manager_address).ledger) == 0)


def test_client_timeout_on_a_unary_request_frees_every_block(mesh, tokenizer):
    body = {"prompt": _ids(tokenizer, 100), "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    with httpx.Client(
        base_url=f"http://{mesh.gateway_address}", trust_env=False, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        assert wait_until(lambda: len(cluster_state(mesh.manager_address).ledger) == 0)
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=2.0))
    left = time.monotonic()
    assert wait_until(lambda: all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger, 10)
    assert time.monotonic() - left < 10


def test_a_request_aborted_in_the_mesh_ends_the_stream_with_finish_reason_abort(oai, sdk, tokenizer, mesh):
    """Only the request's owner may abort it through the router (test_mesh_security.py): here the gateway's
    identity, as an operator holding the gateway's certificate would."""
    from infinite_llm.rpc.tls import TLS_DIR_ENV, load_tls_dir

    sdk = Client(mesh.router_address, tls=load_tls_dir(os.environ[TLS_DIR_ENV], "gateway"))
    stream = oai.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=QUESTION,
        max_tokens=100,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(stream)
    with sdk:
        assert sdk.abort(f"{first.id}-0") is True
    rest = list(stream)
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finishes == ["abort"]
    assert wait_until(lambda: all_blocks_free(mesh))
