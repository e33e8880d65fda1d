"""The HTTP connection protocol: uvicorn's h11 protocol plus a request-header deadline.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but a connection that never sends a request - or sends its
headers a byte at a time - is held forever: a few thousand of them exhaust the server's file
descriptors. Here every connection must deliver a complete request head within
``header_timeout`` seconds of opening, and again after each response.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol_with_header_timeout(header_timeout: float) -> type[asyncio.Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` enforcing ``header_timeout``."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            # The cycle that is current now; a new request replaces it (self.cycle).
            armed = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._expire, armed)

        def _expire(self, armed: Any) -> None:
            waiting = self.cycle is None or (self.cycle is armed and self.cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
