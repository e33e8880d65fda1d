"""ASGI middlewares that guard the app: API key, Host header, request-body size and time.

Plain ASGI classes (not Starlette's BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched. Each refusal is an OpenAI-shaped error (``errors.py``)
and is counted through ``on_refused(status)`` (the metrics).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Callable, Iterable

from core.entrypoints.openai.errors import OpenAIError, clip

Refused = Callable[[int], None] | None


async def _refuse(err: OpenAIError, on_refused: Refused, scope, receive, send) -> None:
    if on_refused is not None:
        on_refused(err.status)
    await err.response()(scope, receive, send)


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


PROTECTED_PATHS = ("/v1", "/tokenize", "/detokenize")
"""Path prefixes the API key guards: everything that runs the model or its tokenizer.
/health, /metrics, /version and the API description stay open (load balancers, Prometheus)."""


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on :data:`PROTECTED_PATHS`; other paths
    (health, metrics) stay open. The key is compared in constant time."""

    def __init__(self, app, api_key: str, on_refused: Refused = None):
        self.app = app
        self._key = api_key.encode()
        self._on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PATHS) and not self._authorized(scope):
            err = OpenAIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await _refuse(err, self._on_refused, scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest takes time independent of where the strings differ.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """A loopback-bound server answers only to loopback names (a web page that re-points its
    own domain at 127.0.0.1 - DNS rebinding - then gets 400s); any other bind accepts any Host."""
    if bind_host == "localhost":
        return LOOPBACK_NAMES
    try:
        loopback = ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return ("*",)
    if not loopback:
        return ("*",)
    bound = f"[{bind_host.strip('[]')}]" if ":" in bind_host else bind_host
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, bound)))


def _host_name(value: bytes) -> str:
    """The Host header without its port, lowercased ('[::1]:8000' -> '[::1]')."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostCheckMiddleware:
    """Answer only requests whose ``Host`` header names this server (``--allowed-hosts``).

    Entries are host names or IPs without a port, ``*.example.com`` for a domain's
    subdomains, or ``*`` for any. A request without a Host header (HTTP/1.0) passes.
    """

    def __init__(self, app, allowed: Iterable[str], on_refused: Refused = None):
        self.app = app
        names = [a.strip().lower() for a in allowed if a.strip()]
        self._any = "*" in names
        self._exact = {n for n in names if not n.startswith("*.")}
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*."))
        self._on_refused = on_refused

    def allows(self, host: str) -> bool:
        return self._any or host in self._exact or (bool(self._suffixes) and host.endswith(self._suffixes))

    async def __call__(self, scope, receive, send) -> None:
        raw = _header(scope, b"host") if scope["type"] in ("http", "websocket") else None
        if raw is not None and not self.allows(_host_name(raw)):
            name = clip(_host_name(raw), 60)
            err = OpenAIError(400, f"Host {name!r} is not allowed on this server (a defence against DNS "
                                   f"rebinding); start it with --allowed-hosts {name} to accept it",
                              param=None, code="host_not_allowed")
            await _refuse(err, self._on_refused, scope, receive, send)
            return
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Read each request body fully before the app runs, within limits.

    * larger than ``max_bytes`` -> 413; when ``Content-Length`` already says so, before
      reading any of it (the connection is then closed, as the rest is never read);
    * not complete ``timeout`` seconds after the headers -> 408 (a slow sender cannot hold a
      request open).

    The app then receives the body as one message and, after it, the client's real
    messages (so disconnects still reach the handlers).
    """

    def __init__(self, app, max_bytes: int, timeout: float, on_refused: Refused = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _refuse(self._too_large(int(declared)), self._on_refused, scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except _TooLarge:
            await _refuse(self._too_large(None), self._on_refused, scope, receive, send)
            return
        except TimeoutError:
            err = OpenAIError(408, f"the request body did not arrive within {self.timeout:g} s "
                                   "(--timeout-body); send it promptly", code="body_timeout",
                              headers={"Connection": "close"})
            await _refuse(err, self._on_refused, scope, receive, send)
            return
        if body is None:
            return  # the client left while sending; nobody to answer
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, declared: int | None) -> OpenAIError:
        size = f"{declared} bytes" if declared is not None else "more than the limit"
        return OpenAIError(413, f"the request body is {size}; this server takes at most {self.max_bytes} bytes "
                                "(--max-request-body-bytes); send a shorter prompt", code="request_too_large",
                           headers={"Connection": "close"})


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
