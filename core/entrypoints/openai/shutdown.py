"""What happens to open requests when the shutdown grace period runs out.

After SIGTERM uvicorn stops accepting connections and waits for the open ones. When
``--shutdown-grace-period`` seconds have passed, :class:`ShutdownGrace` ends every request
still open *itself*: a stream gets a final SSE error event and ``[DONE]``, a non-streamed
request a 503, and their engine requests are aborted. uvicorn's own deadline (which cancels
handler tasks mid-write: a cut stream and a traceback per request) is set later than ours
and is only a backstop. One log line says how many requests were ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TypeVar

from core.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("core.entrypoints.openai")

T = TypeVar("T")

BACKSTOP_S = 10.0
"""How much longer than the grace period uvicorn waits before cancelling tasks itself."""


class ShutdownGrace:
    """Counts open requests and, once the grace period after the exit signal has run out,
    makes :meth:`until_expired` / :attr:`expired` end them."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.expired = asyncio.Event()
        self.open = 0
        self._countdown: asyncio.Task | None = None

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the countdown (safe to call from a signal handler; idempotent)."""
        loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        if self._countdown is None:
            self._countdown = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(self.grace_s)
        if self.open:
            logger.warning("the shutdown grace period (%g s) ran out: ending %d open request(s) with an error",
                           self.grace_s, self.open)
        self.expired.set()

    @contextmanager
    def request(self) -> Iterator[None]:
        """Count one open request for as long as the block runs."""
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1

    def error(self) -> OpenAIError:
        return OpenAIError(503, f"the server is shutting down and its grace period (--shutdown-grace-period "
                                f"{self.grace_s:g} s) ran out before this request finished; retry it",
                           code="server_shutting_down")

    async def until_expired(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """``items`` until they end, or until the grace period ran out (then raise :meth:`error`).
        Closing this iterator closes ``items``."""
        expired = asyncio.ensure_future(self.expired.wait())
        step: asyncio.Future | None = None
        with self.request():
            try:
                while True:
                    step = asyncio.ensure_future(items.__anext__())
                    await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
                    if not step.done():
                        raise self.error()
                    try:
                        item = step.result()
                    except StopAsyncIteration:
                        return
                    yield item
            finally:
                expired.cancel()
                if step is not None and not step.done():  # items cannot be closed while it runs
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                close = getattr(items, "aclose", None)
                if close is not None:
                    await close()
