"""OpenAI error objects and the statuses the server answers with.

Every error is ``{"error": {"message", "type", "param", "code"}}`` (``code`` = the HTTP status, as vLLM does):

- 400 ``invalid_request_error``: malformed JSON, a wrong type or a bad value (``param`` names the field), a
  prompt longer than ``max_model_len``, an unsupported feature;
- 401 ``authentication_error``: a missing or wrong API key when the server was started with ``--api-key``;
- 404 ``not_found_error``: an unknown model or route;
- 413 ``invalid_request_error``: a body larger than ``--max-request-bytes``;
- 499: the client disconnected (nobody reads it; one INFO line is logged, no traceback);
- 503 ``service_unavailable``: the engine has failed;
- 500 ``internal_error``: anything else (logged with its traceback; the server keeps serving).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("rocm_k3.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class APIError(Exception):
    """An error answered as an OpenAI error object with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(exc: Exception, default_param: str | None = None) -> APIError:
    """A 400 from a ValueError/TypeError whose message starts with the field it names (``"top_p: ..."``)."""
    message = str(exc)
    match = _FIELD_PREFIX.match(message)
    return APIError(400, message, param=match.group(1) if match else default_param)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_path(loc: tuple) -> str | None:
    """``("messages", 0, "role")`` -> ``messages[0].role``; pydantic's union-member tags (``str``, ``list[int]``)
    are left out, so the path names the request's own field."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or part.startswith("function-"):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a pydantic validation error (and how many more there are)."""
    errors = exc.errors()
    first = errors[0]
    param = field_path(first["loc"])
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f", got {got!r}"
    return APIError(400, f"{param}: {first['msg']}{shown}{more}", param=param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure as an OpenAI error object (never a bare traceback, never a dead server)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        return error_response(exc.status_code, message)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:  # an expected event: one line
        log.info("%s: the client disconnected before its request was read", request.url.path)
        return error_response(499, "the client disconnected")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
