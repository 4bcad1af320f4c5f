"""Errors of the REST gateway as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

Every typed error (``infinite_llm.core.errors``) carries its HTTP status and OpenAI type/code, and the
router's errors arrive as their exact class with their param (``infinite_llm.rpc.errors``); this module
adds the few that only the gateway raises and installs the FastAPI handlers, FastAPI's 422 for a malformed
body included (OpenAI answers 400).
"""

from __future__ import annotations

import logging
import reprlib

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
        rid = getattr(request.state, "request_id", None)
        of = f" (request {rid})" if rid else ""
        log.warning("%s %s%s -> %d: %s", request.method, request.url.path, of, e.http_status, e.message)
    return error_response(e.http_status, error_body(e))


async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
    """FastAPI would answer 422 with its own shape; OpenAI answers 400 naming the first bad parameter, what it
    expected and what it got (:func:`validation_message`)."""
    errors = e.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): no parameter is at fault
        where = first.get("loc", ("body", "?"))[-1]
        detail = (first.get("ctx") or {}).get("error", first["msg"])
        message = f"the request body is not valid JSON: {detail} (at character {where})"
        return error_response(400, ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error")))
    param, message = validation_message(errors, request.headers.get("content-type", ""))
    return error_response(
        400, ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error", param=param))
    )


_ALTERNATIVES = {  # pydantic's tags of a union's members (and the types JSON decodes to), as OpenAI names them
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "list": "an array",
    "dict": "an object",
    "list[int]": "an array of token ids",
    "list[str]": "an array of strings",
    "list[list[int]]": "an array of arrays of token ids",
    "list[ContentPart]": "an array of content parts",
    "dict[str,any]": "an object",
}


def _short_repr(value: object) -> str:
    """``repr(value)`` cut to about 200 characters without building the whole of a huge value's repr."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 160
    short.maxlist = short.maxdict = short.maxtuple = 8
    short.maxlevel = 3
    return short.repr(value)


def _json_type(value: object) -> str:
    name = type(value).__name__
    return "null" if value is None else _ALTERNATIVES.get(name, name)


def _is_tag(part: object) -> bool:
    """A union member's tag in a pydantic error location (``str``, ``list[int]``), not a field or an index."""
    return isinstance(part, str) and ("[" in part or part in _ALTERNATIVES)


def validation_message(errors: list[dict], content_type: str = "") -> tuple[str | None, str]:
    """``(param, message)`` for the first of pydantic's ``errors`` of a request body (locations start with
    ``"body"``). A value no member of a union accepts is one problem, named by its field (``prompt``, not
    pydantic's ``prompt.str``), with the types it may take; a wrong type or value says what came instead."""
    if not errors:
        return None, "invalid request body"
    first = errors[0]

    def path(err: dict) -> list:
        out = []
        for part in err.get("loc", ()):
            if _is_tag(part):
                break
            out.append(part)
        return out[1:] if out[:1] == ["body"] else out

    where = path(first)
    param = ".".join(map(str, where)) or None
    if param is None:  # the body itself: missing, or not a JSON object
        if first.get("type") == "missing":
            return None, "the request body is missing: send a JSON object (Content-Type: application/json)"
        told = "" if "json" in content_type else f" (Content-Type {content_type or 'not given'}; send application/json)"
        return None, f"the request body must be a JSON object, got {_json_type(first.get('input'))}{told}"
    same = [err for err in errors if path(err) == where]
    tags = list(dict.fromkeys(p for err in same for p in err.get("loc", ()) if _is_tag(p)))
    if len(tags) > 1:  # no member of the union took it
        names = [_ALTERNATIVES.get(t, t) for t in tags]
        message = f"{param}: expected {', '.join(names[:-1])} or {names[-1]}"
        whole = [err for err in same if len(err.get("loc", ())) == len(where) + 2 and "input" in err]  # not an item
        if whole:
            message += f", got {_json_type(whole[0]['input'])}"
    else:
        message = f"{param}: {first['msg']}"
        kind = str(first.get("type", ""))
        if kind.endswith("_type") or kind.endswith("_parsing"):
            message += f", got {_json_type(first.get('input'))}"
        elif kind not in ("missing", "value_error") and "input" in first:
            message += f", got {_short_repr(first['input'])}"
    left = len(errors) - len(same)
    if left > 0:
        message += f" (and {left} more problem{'s' if left > 1 else ''})"
    return param, message


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
