"""Errors of the REST gateway as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

Every typed error (``infinite_llm.core.errors``) carries its HTTP status and OpenAI type/code, and the
router's errors arrive as their exact class with their param (``infinite_llm.rpc.errors``); this module
adds the few that only the gateway raises and installs the FastAPI handlers, FastAPI's 422 for a malformed
body included (OpenAI answers 400).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infinite_llm.core.errors import InfiniteLLMError
from infinite_llm.services.gateway.protocol import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)


class AuthenticationFailed(InfiniteLLMError):
    """No API key, or a wrong one, while the gateway requires one."""

    http_status = 401
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"


class MissingApiKey(AuthenticationFailed):
    """No ``Authorization: Bearer`` header at all (OpenAI leaves ``code`` empty for this one)."""

    openai_code = None


class RequestAborted(InfiniteLLMError):
    """The mesh aborted the request before it finished (a Router ``Abort`` call): the output is partial."""

    grpc_code = "ABORTED"
    http_status = 503
    openai_type = "server_error"
    openai_code = "request_aborted"


def error_body(e: InfiniteLLMError) -> ErrorResponse:
    return ErrorResponse(error=ErrorBody(message=e.message, type=e.openai_type, param=e.param, code=e.openai_code))


def error_response(status: int, body: ErrorResponse) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status)


async def _typed(request: Request, e: InfiniteLLMError) -> JSONResponse:
    if e.http_status >= 500:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, e.http_status, e.message)
    return error_response(e.http_status, error_body(e))


async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
    """FastAPI would answer 422 with its own shape; OpenAI answers 400 naming the first bad parameter."""
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): no parameter is at fault
        where = first.get("loc", ("body", "?"))[-1]
        detail = (first.get("ctx") or {}).get("error", first["msg"])
        message = f"the request body is not valid JSON: {detail} (at character {where})"
        return error_response(400, ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error")))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(
        400, ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error", param=param))
    )


async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
    message = f"{e.detail} ({request.method} {request.url.path})"
    return error_response(e.status_code, ErrorResponse(error=ErrorBody(message=message, type=kind)))


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return error_response(
        500, ErrorResponse(error=ErrorBody(message=f"internal error: {type(e).__name__}", type="server_error"))
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(InfiniteLLMError, _typed)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
