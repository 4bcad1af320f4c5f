"""The gateway takes request bodies up to ``max_request_bytes``: a larger one is a 413 OpenAI error object,
before it is parsed, whether its size is declared (``Content-Length``) or only counted as it arrives
(chunked); the API key is checked before (a caller without it learns 401, not the limit), and the gateway
stays up. The real gateway app over the tests' real router (its compute instance unreachable: a request that
passes every check gets 503)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from infinite_llm.services.gateway.app import create_app
from infinite_llm.services.gateway.backend import RouterBackend

LIMIT = 64 * 1024


def _client(router_address, tokenizer, **kwargs) -> TestClient:  # noqa: ANN001
    return TestClient(create_app(RouterBackend(router_address, tokenizer, tls=None), **kwargs))


def _body(size: int) -> bytes:
    """A completion request of exactly ``size`` bytes (its ``user`` field padded: the prompt stays short)."""
    base = json.dumps({"prompt": "hi", "max_tokens": 1, "user": ""}).encode()
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "user": "x" * (size - len(base))}).encode()
    assert len(body) == size
    return body


WANT = {
    "message": "the request body is larger than this gateway takes (64.0KiB; serve gateway --max-request-bytes) "
    "(POST /v1/completions)",
    "type": "invalid_request_error",
    "param": None,
    "code": None,
}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_and_one_at_the_limit_goes_on(router_address, tokenizer, chunked):
    def send(c: TestClient, body: bytes):  # noqa: ANN202
        headers = {"content-type": "application/json"}
        if chunked:  # no Content-Length: the gateway counts what arrives
            pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)]
            return c.post("/v1/completions", content=iter(pieces), headers=headers)
        return c.post("/v1/completions", content=body, headers=headers)

    with _client(router_address, tokenizer, max_request_bytes=LIMIT) as c:
        over = send(c, _body(LIMIT + 1))
        assert over.status_code == 413, over.text
        assert over.json() == {"error": WANT}
        at = send(c, _body(LIMIT))
        assert at.status_code == 503, at.text  # parsed, checked and sent on: the mesh is unreachable
        assert c.get("/v1/models").status_code == 200  # still serving
        # counted under its route either way (a declared size is refused before routing)
        metrics = c.get("/metrics").text
        assert 'infinite_llm:gateway_requests_total{route="/v1/completions",status="413"} 1.0' in metrics, metrics


def test_the_api_key_is_checked_before_the_size_and_zero_means_no_limit(router_address, tokenizer):
    with _client(router_address, tokenizer, max_request_bytes=LIMIT, api_key="k1") as c:
        r = c.post("/v1/completions", content=_body(LIMIT + 1), headers={"content-type": "application/json"})
        assert r.status_code == 401, r.text
        r = c.post("/v1/completions", content=_body(LIMIT + 1), headers={"authorization": "Bearer k1"})
        assert r.status_code == 413, r.text
        metrics = c.get("/metrics").text  # a 401 keeps its label: refused before routing, as any path would be
        assert 'infinite_llm:gateway_requests_total{route="other",status="401"} 1.0' in metrics, metrics
        assert 'infinite_llm:gateway_requests_total{route="/v1/completions",status="413"} 1.0' in metrics, metrics
    with _client(router_address, tokenizer, max_request_bytes=0) as c:
        r = c.post("/v1/completions", content=_body(4 * LIMIT), headers={"content-type": "application/json"})
        assert r.status_code == 503, r.text
