"""AsyncLLMEngine: one background thread drives :class:`~core.engine.LLMEngine`; asyncio
code talks to it through commands and per-request streams.

Invariants:

- The engine object is touched only by the engine thread (it is not thread-safe). Other
  threads send commands (add, abort, call, stop) that the thread runs between steps.
- A request's stream is registered *before* its add command is queued, so every output the
  engine produces for it is delivered; the stream ends after the finished output.
- A consumer that stops early (cancelled task, closed iterator) aborts its request; the
  engine frees its KV blocks when it runs the abort command, before the next step.
- If a step raises, the engine is dead: every waiting consumer receives
  :class:`EngineDeadError`, new requests are refused, and :meth:`check_health` raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from core.engine import LLMEngine
from core.engine_args import EngineArgs
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped because of an error; the server must be restarted."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine-wide numbers copied by the engine thread after each step (read by /metrics)."""

    scheduler: Any
    """The scheduler's ``stats()`` value (SchedulerStats), or None before the first step."""
    prompt_tokens: int = 0
    generation_tokens: int = 0


class RequestStream:
    """Outputs of one request, fed from the engine thread, read by one asyncio consumer.

    An async iterator of cumulative :class:`RequestOutput` values (when the consumer falls
    behind, intermediate ones are skipped: the latest already contains them) that ends
    after the finished output. A consumer that stops early must call :meth:`close` (or use
    ``contextlib.aclosing``); a consumer cancelled while waiting closes it automatically.
    Closing an unfinished stream aborts the request.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._abort = abort
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hand an output (or an error) to the consumer."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed; nobody is listening
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()  # coalesce: outputs are cumulative
        if isinstance(item, BaseException):
            self.finished = True  # the engine is gone; nothing to abort
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLMEngine:
    """Runs an :class:`LLMEngine` on a background thread for asyncio servers.

    Use :meth:`add_request` (returns a :class:`RequestStream` once the engine accepted the
    request, raising its ``ValueError`` / ``EngineOverloaded`` otherwise) or :meth:`generate`
    (the same as one async iterator).
    """

    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self._on_finished = on_finished
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and _dead
        self._dead: BaseException | None = None
        self._shut_down = False
        self._ids = 0
        self.snapshot = EngineSnapshot(scheduler=None)
        self._thread = threading.Thread(target=self._run, name="core-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_args(args), **kwargs)

    # ---- public API (any thread / event loop) ---------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it."""
        request_id = request_id or self._next_id()
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # commands are queued under the lock so _die() fails them all
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use; ids must be unique")
            self._streams[request_id] = stream  # before the add: no output can be missed
            self._commands.put(("add", fut, request_id, prompt, params, priority, arrival_time))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            refused = fut.done() and not fut.cancelled() and fut.exception() is not None
            if not refused:  # cancelled: the add may have run already; the abort follows it
                self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Every output of the request, ending after the finished one."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking); its blocks are freed before the next step."""
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (e.g. to use the tokenizer,
        which is not safe to share between threads) and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_dead()
            self._commands.put(("call", fut, fn))
        return await asyncio.wrap_future(fut)

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine loop died or stopped, or a worker
        process of the executor died. May block (a Ray ping): call it off the event loop."""
        with self._lock:
            self._raise_if_dead()
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        try:  # a tensor-parallel worker may have died while the engine sat idle
            self.engine.executor.check_health()
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from e

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or not self._thread.is_alive()

    def num_open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop and release the engine (idempotent). Consumers still waiting get
        :class:`EngineDeadError`."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)
        self.engine.shutdown()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._run_commands(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                self._publish_snapshot()
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; tell everyone
            logger.exception("engine loop failed; the engine is dead")
            self._die(e)
            return
        self._die(EngineDeadError("the engine was shut down"))

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if ``block``); False once told to stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            self._run_command(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                self._publish_snapshot()
                return True

    def _run_command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind in ("add", "call") and not cmd[1].set_running_or_notify_cancel():
            return  # the caller gave up before the command ran
        if kind == "add":
            _, fut, request_id, prompt, params, priority, arrival = cmd
            try:
                self.engine.add_request(request_id, prompt, params, priority, arrival)
            except Exception as e:  # a refused request; the engine itself is fine
                fut.set_exception(e)
            else:
                fut.set_result(request_id)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fut, fn = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished and self._on_finished is not None:
                try:
                    self._on_finished(out)
                except Exception:  # metrics must never take the engine down
                    logger.exception("on_finished callback failed for %s", out.request_id)
            with self._lock:
                stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _publish_snapshot(self) -> None:
        c = self.engine.output_processor.counters
        self.snapshot = EngineSnapshot(self.engine.scheduler.stats(), c.prompt_tokens, c.generation_tokens)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            streams, self._streams = list(self._streams.values()), {}
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine failed: {exc!r}; restart the server")
        for s in streams:
            s.put(err)
        while True:  # fail commands that will never run
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call") and cmd[1].set_running_or_notify_cancel():
                cmd[1].set_exception(err)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            if isinstance(self._dead, EngineDeadError):
                raise self._dead
            raise EngineDeadError(f"the engine failed earlier: {self._dead!r}; restart the server")

    def _next_id(self) -> str:
        with self._lock:
            self._ids += 1
            return f"async-{self._ids}"
