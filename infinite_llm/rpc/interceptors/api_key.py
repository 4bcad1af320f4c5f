"""Server interceptor: API keys on the router's gRPC door, as the gateway has on its REST one.

With keys configured, a call must carry metadata ``authorization: Bearer <key>`` with one of them, else
UNAUTHENTICATED (no key, a malformed header, or a wrong key). The gateway role is exempt: it checks its own
callers' keys on ``/v1``. Health and reflection stay open. :func:`tenant_of` names whose request a call
is (certificate identity and key), so one client cannot abort another's request.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
from collections.abc import AsyncIterator, Sequence

import grpc

from infinite_llm.core.errors import Unauthenticated
from infinite_llm.rpc.access import OPEN_SERVICES, split_method
from infinite_llm.rpc.interceptors._wrap import wrap_handler
from infinite_llm.rpc.tls import peer_of

AUTHORIZATION_KEY = "authorization"
EXEMPT_ROLES = frozenset({"gateway"})
_TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 section 2.1: what a Bearer token may be


def check_api_key(key: str, flag: str = "--api-key") -> str:
    """``key`` if it can travel as ``Authorization: Bearer <key>`` (RFC 6750 ``b64token``: letters, digits,
    ``-._~+/``, then ``=`` padding); else ``ValueError`` naming ``flag`` (never the key itself). A key with a
    space or a comma used to be split into several shorter keys (the router) or to be one no client could send
    in the header's grammar (the gateway)."""
    if not _TOKEN68.fullmatch(key):
        raise ValueError(
            f"{flag}: an API key must be one RFC 6750 bearer token (letters, digits, '-._~+/' and trailing '='; "
            f"no spaces or commas); got one of {len(key)} characters that is not"
        )
    return key


def bearer_token(context: grpc.aio.ServicerContext) -> str | None:
    """The token of the call's ``authorization: Bearer <token>`` metadata (None without one)."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def tenant_of(context: grpc.aio.ServicerContext) -> str:
    """Who a call is on behalf of: the certificate's identity and a digest of its API key (if any)."""
    token = bearer_token(context) or ""
    digest = hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""
    return f"{peer_of(context).identity}|{digest}"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires one of ``api_keys`` (none given: admits every call)."""

    def __init__(self, api_keys: Sequence[str]) -> None:
        self.api_keys = [check_api_key(k).encode() for k in api_keys if k]

    def _check(self, context: grpc.aio.ServicerContext) -> None:
        if peer_of(context).role in EXEMPT_ROLES:
            return
        token = bearer_token(context)
        if token is None:
            raise Unauthenticated(
                "no API key; send metadata 'authorization: Bearer <key>' (the SDK's api_key=, the CLI's --api-key "
                "or INFINITE_LLM_API_KEY)"
            )
        if not any(secrets.compare_digest(token.encode(), key) for key in self.api_keys):
            raise Unauthenticated("incorrect API key")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if not self.api_keys or split_method(handler_call_details.method)[0] in OPEN_SERVICES:
            return handler

        @contextlib.asynccontextmanager
        async def checked(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            self._check(context)
            yield

        return wrap_handler(handler, checked)
