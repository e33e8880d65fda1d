"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes goes through :class:`OpenAIError` or one of the handlers
installed by :func:`install_error_handlers`, so a client never sees FastAPI's default
``{"detail": ...}`` body, and never a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 503: "server_error", 500: "server_error"}


class OpenAIError(Exception):
    """A refusal with its HTTP status, in OpenAI's error vocabulary."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event (for failures after a stream started)."""
        return f"data: {json.dumps(self.body().model_dump())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _input_path(body: Any, loc: Sequence[Any], missing: bool) -> tuple[str, str, tuple[int, ...]]:
    """(top-level field, readable path, rank) of an error location inside the parsed body.

    pydantic puts union member tags ('str', 'list[int]') and '[key]' into ``loc``; walking
    the body itself keeps only the steps that exist in the input, so ``prompt: [true]`` is
    reported at ``prompt[0]``, not ``prompt.list[int].0``.
    """
    top, path, node, rank = "", "", body, []
    for step in loc:
        rank.append(step if isinstance(step, int) else -1)
        if isinstance(node, dict) and isinstance(step, str) and step in node:
            node = node[step]
            top = top or step
            path = f"{path}.{step}" if path else step
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
            path = f"{path}[{step}]"
        elif missing and step is loc[-1] and isinstance(node, dict) and isinstance(step, str):
            top = top or step  # the required field that is absent
            path = f"{path}.{step}" if path else step
        else:
            rank.pop()
    # how far into the input the error is: deeper, then later in a list, is further
    return top, path, (len(rank), *rank)


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters: errors quote what the client sent, never all of it."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def _shown(value: Any) -> str:
    return clip(repr(value), 60)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        # pydantic's location here is a character offset, not a field: say what is wrong instead.
        reason = next(str(e.get("ctx", {}).get("error", "")) for e in errors if e.get("type") == "json_invalid")
        return bad_request(f"the request body is not valid JSON ({reason or 'malformed'}); send one JSON object "
                           "with Content-Type: application/json", code="invalid_json")
    body = getattr(exc, "body", None)
    # A union reports one error per member: keep, per field, the deepest location the
    # members reached and what each of them wanted there ("a valid string / integer").
    best: dict[str, tuple[tuple[int, ...], str, list[str], dict]] = {}
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        top, path, rank = _input_path(body, loc, err.get("type") == "missing")
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if top not in best or rank > best[top][0]:
            best[top] = (rank, path, [msg], err)
        elif rank == best[top][0] and msg not in best[top][2]:
            best[top][2].append(msg)
    parts = []
    for _, path, msgs, err in list(best.values())[:3]:
        got = f" (got {_shown(err['input'])})" if "input" in err and err.get("type") != "missing" else ""
        text = " / ".join(msgs)
        parts.append(f"{path}: {text}{got}" if path else f"{text}{got}")
    more = f" (and {len(best) - 3} more invalid field(s))" if len(best) > 3 else ""
    first = next(iter(best), None) or None
    return bad_request("invalid request: " + "; ".join(parts) + more, param=first)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Map every error FastAPI/Starlette can raise to the OpenAI shape; ``on_error(status)``
    is told about each (for metrics)."""

    def respond(err: OpenAIError, request: Request) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        # Messages name fields and numbers, never prompt text, so they are safe to log.
        logger.info("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message[:300])
        return err.response()

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return respond(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(_validation_error(exc), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        path = clip(request.url.path)
        if exc.status_code == 404:
            message = f"no route {request.method} {path}; see /openapi.json"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {path}"
        return respond(OpenAIError(exc.status_code, message, headers=getattr(exc, "headers", None)), request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s: %r", request.method, request.url.path, exc, exc_info=exc)
        return respond(OpenAIError(500, "internal server error; see the server log", code="internal_error"), request)
