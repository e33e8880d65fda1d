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


class _Consumer:
    """One open :meth:`ShutdownGrace.until_expired`: the task that reads it and whether that
    task is waiting for the next item right now."""

    __slots__ = ("task", "waiting", "ended")

    def __init__(self, task: asyncio.Task | None):
        self.task = task
        self.waiting = False
        self.ended = False
        """Set when the grace ran out while the task waited: its cancel is ours."""


class ShutdownGrace:
    """Counts open requests and, once the grace period after the exit signal has run out,
    makes :meth:`until_expired` / :attr:`expired` end them."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.expired = asyncio.Event()
        self.open = 0
        self._countdown: asyncio.Task | None = None
        self._consumers: set[_Consumer] = set()

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
        # A reader waiting for its next item is woken by a cancel that until_expired turns
        # into the error; one busy elsewhere (writing a chunk) sees `expired` when it next asks.
        for consumer in list(self._consumers):
            if consumer.waiting and consumer.task is not None:
                consumer.ended = True
                consumer.task.cancel()

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
        Closing this iterator closes ``items``.

        Nothing is spent per item (an earlier form raced every item against the expiry with
        a task and ``asyncio.wait``: ~9 us of the API process's ~118 us per streamed token,
        docs/benchmarks/api_cost.md): the expiry cancels the reading task while it waits,
        and the cancel becomes the error.
        """
        consumer = _Consumer(asyncio.current_task())
        with self.request():
            self._consumers.add(consumer)
            try:
                while True:
                    if self.expired.is_set():
                        raise self.error()
                    consumer.waiting = True
                    try:
                        item = await items.__anext__()
                    except StopAsyncIteration:
                        return
                    except asyncio.CancelledError:
                        if not consumer.ended:
                            raise
                        consumer.task.uncancel()
                        raise self.error() from None
                    finally:
                        consumer.waiting = False
                    yield item
            finally:
                self._consumers.discard(consumer)
                aclose = getattr(items, "aclose", None)
                if aclose is not None:
                    await aclose()
