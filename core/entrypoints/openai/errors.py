"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes goes through :class:`OpenAIError` or one of the handlers
installed by :func:`install_error_handlers`, so a client never sees FastAPI's default
``{"detail": ...}`` body, and never a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

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


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    parts, first_param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        first_param = first_param or (where or None)
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return bad_request("invalid request: " + "; ".join(parts) + more, param=first_param)


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
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /openapi.json"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return respond(OpenAIError(exc.status_code, message, headers=getattr(exc, "headers", None)), request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s: %r", request.method, request.url.path, exc, exc_info=exc)
        return respond(OpenAIError(500, "internal server error; see the server log", code="internal_error"), request)
