"""Request ids and the server's log lines.

Every HTTP response carries an ``x-request-id`` header: the client's own when it sent a sane one (1-128 characters
of ``A-Z a-z 0-9 . _ : @ / + = -``), else a fresh one. While a request is handled the id sits in a context variable
(:data:`REQUEST_ID`; ``asyncio`` tasks and ``asyncio.to_thread`` inherit it), the engine request ids start with it
(``chatcmpl-<id>-0``), and :class:`RequestIdFilter` adds it to every log line (``[<id>]``).
:func:`serve_log_config` is the logging setup of ``rocm-k3 serve`` (given to uvicorn): the ``rocm_k3`` and
uvicorn loggers at their levels, request ids on every handler, and no tracebacks for expected events
(:class:`ExpectedEventFilter`: a task cancelled by the shutdown, a client that went away).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from contextvars import ContextVar
from typing import Any

from starlette.requests import ClientDisconnect

REQUEST_ID: ContextVar[str | None] = ContextVar("rocm_k3_request_id", default=None)
_CLIENT_CHOSEN: ContextVar[bool] = ContextVar("rocm_k3_request_id_client_chosen", default=False)
HEADER = "x-request-id"
_SANE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def new_id() -> str:
    return uuid.uuid4().hex


def request_id_from(raw: bytes | None) -> tuple[str, bool]:
    """(the id to use, whether the client chose it): the client's ``x-request-id`` when sane, else a new one."""
    if raw is not None:
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        if _SANE.fullmatch(text):
            return text, True
    return new_id(), False


class RequestIdMiddleware:
    """ASGI middleware: sets :data:`REQUEST_ID` for the request and adds the ``x-request-id`` response header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope.get("headers", ()) if k.lower() == HEADER.encode()), None)
        rid, chosen = request_id_from(sent)
        header = (HEADER.encode(), rid.encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers", ()) if h[0].lower() != header[0]]
                message = {**message, "headers": [*kept, header]}
            await send(message)

        token, chosen_token = REQUEST_ID.set(rid), _CLIENT_CHOSEN.set(chosen)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
            _CLIENT_CHOSEN.reset(chosen_token)


def engine_request_id(prefix: str) -> str:
    """The engine id of a request being handled: ``{prefix}-{request id}`` (plus a short suffix when the client
    chose the id, which it may reuse), or ``{prefix}-{new id}`` outside a request."""
    rid = REQUEST_ID.get()
    if rid is None:
        return f"{prefix}-{new_id()}"
    return f"{prefix}-{rid}-{new_id()[:8]}" if _CLIENT_CHOSEN.get() else f"{prefix}-{rid}"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (or ``-``) and ``request_tag`` (``"[id] "`` or empty) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_id = rid or "-"
        record.request_tag = f"[{rid}] " if rid else ""
        return True


class ExpectedEventFilter(logging.Filter):
    """Drops records whose exception is an expected event, not a fault: a task cancelled by the shutdown
    (``CancelledError``, e.g. a stream in flight when a second Ctrl-C lands) or a client that disconnected. The
    server logs one INFO line of its own for each (``serving_common.logged_stream``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (asyncio.CancelledError, ClientDisconnect))


def serve_log_config(log_level: str, uvicorn_log_level: str) -> dict:
    """The ``logging.config.dictConfig`` of ``rocm-k3 serve`` (uvicorn applies it): uvicorn's handlers and
    formats with the request id, the ``rocm_k3`` logger at ``log_level`` with its name in each line."""
    filters = ["request_id", "expected"]
    default = "uvicorn.logging.DefaultFormatter"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}, "expected": {"()": ExpectedEventFilter}},
        "formatters": {
            "default": {"()": default, "fmt": "%(levelprefix)s %(request_tag)s%(message)s", "use_colors": None},
            "rocm_k3": {"()": default, "fmt": "%(levelprefix)s %(request_tag)s%(name)s: %(message)s",
                        "use_colors": None},
            "access": {"()": "uvicorn.logging.AccessFormatter",
                       "fmt": '%(levelprefix)s %(request_tag)s%(client_addr)s - "%(request_line)s" %(status_code)s'},
        },
        "handlers": {
            "default": {"formatter": "default", "class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                        "filters": filters},
            "rocm_k3": {"formatter": "rocm_k3", "class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                        "filters": filters},
            "access": {"formatter": "access", "class": "logging.StreamHandler", "stream": "ext://sys.stdout",
                       "filters": filters},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": uvicorn_log_level.upper(), "propagate": False},
            "uvicorn.error": {"level": uvicorn_log_level.upper()},
            "uvicorn.access": {"handlers": ["access"], "level": uvicorn_log_level.upper(), "propagate": False},
            "rocm_k3": {"handlers": ["rocm_k3"], "level": log_level.upper(), "propagate": False},
        },
    }
