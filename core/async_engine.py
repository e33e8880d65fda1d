"""AsyncLLMEngine: the front end of an engine core that runs in its own process.

The engine core (:mod:`core.engine_core.process`) only schedules, executes and updates;
this process keeps everything else: tokenization (on its own thread, so a huge prompt never
stalls generation), detokenization and stop strings (on the output thread), and the asyncio
streams the HTTP handlers read.

Invariants:

- A request's stream and output state are registered *before* its add command is sent, so
  every delta the engine core produces for it is delivered; the stream ends after the
  finished output.
- :meth:`AsyncLLMEngine.add_request` returns once the engine core accepted the request, and
  raises its ``ValueError`` (HTTP 400) or :class:`~core.engine.EngineOverloaded` (503).
- A consumer that stops early (cancelled task, closed iterator) aborts its request: the abort
  crosses to the engine core, which frees its KV blocks before its next step.
- If the engine core dies (a failed step, a crash, SIGKILL), every waiting consumer receives
  :class:`EngineDeadError` within about :data:`POLL_S`, new requests are refused, and
  :meth:`check_health` raises. No wait is unbounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq

from core.engine_args import EngineArgs
from core.engine_core.core import EngineCore, EngineOverloaded
from core.engine_core.process import (
    AbortRequests,
    Acks,
    AddRequest,
    Dead,
    Message,
    Ready,
    Shutdown,
    StartupFailed,
    Stats,
    StepOutputs,
    StopSample,
    build_engine_core,
    run_engine_core,
)
from core.engine_core.types import EngineInfo
from core.input_processor import InputProcessor
from core.output_processor import OutputProcessor
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams
from core.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.1
"""How often the output thread checks that the engine-core process is alive while it is quiet."""
STARTUP_TIMEOUT_S = 1800.0
"""Longest wait for the engine core to load the model (a large checkpoint, a first kernel build)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped because of an error; the server must be restarted."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message says why."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine-wide numbers, replaced after each step and command batch (read by /metrics)."""

    scheduler: Any
    """The scheduler's ``stats()`` value (SchedulerStats), or None before the first step."""
    prompt_tokens: int = 0
    generation_tokens: int = 0


class RequestStream:
    """Outputs of one request, fed from the output thread, read by one asyncio consumer.

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

    @staticmethod
    def put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Thread-safe: :meth:`put` for many streams with one wake-up per event loop, not
        one per stream (a step's outputs for 256 streams were 256 self-pipe writes, each a
        syscall and a loop iteration, all on the output thread's GIL share)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream._loop, []).append((stream._queue, item))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, pairs)
            except RuntimeError:  # that event loop is closed; nobody is listening
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


class _TokenizerPrefetch:
    """Loads the front end's two tokenizers while the engine core starts, from where the
    engine core will say they are (its :class:`EngineInfo` is only known once it is ready).

    The guess is ``resolve_config``'s own rule (``--tokenizer``, else what
    ``model_loader.locate_model`` names: the model directory, or a GGUF file's vocabulary). :meth:`result` uses the prefetched pair only when the engine
    core's answer is that same source, and loads it anew otherwise (or when the guess
    failed: the engine core's own error then says why). Importing transformers and building
    a 128k-token vocabulary took ~2 s of the API process after the engine was ready.
    """

    def __init__(self, args: EngineArgs):
        self._source = _tokenizer_source(args)
        self._pair: tuple[Any, Any] | None = None
        self._thread: threading.Thread | None = None
        if self._source is not None:
            self._thread = threading.Thread(target=self._load, name="core-tokenizer-prefetch", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            self._pair = (load_tokenizer(*self._source), load_tokenizer(*self._source))
        except Exception:  # noqa: BLE001 - a wrong guess; result() loads what the core names
            logger.debug("tokenizer prefetch from %s failed", self._source, exc_info=True)

    def result(self, source: tuple[str, str | None, str | None]) -> tuple[Any, Any]:
        if self._thread is not None:
            self._thread.join()
        if self._pair is not None and source == self._source:
            return self._pair
        return load_tokenizer(*source), load_tokenizer(*source)


def _tokenizer_source(args: EngineArgs) -> tuple[str, str | None, str | None] | None:
    """(tokenizer path, GGUF file, cache dir) as the engine core will resolve them, or None
    when it cannot be told here (the engine core's own error then says why)."""
    from core import envs
    from core.model_loader import default_model_path, locate_model

    try:
        gguf_file, tok_path = locate_model(args.model or default_model_path())
    except FileNotFoundError:
        return None
    return args.tokenizer or tok_path, gguf_file, envs.read().cache_dir


def _put_each(pairs: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


class AsyncLLMEngine:
    """Starts an engine-core process for ``args`` and serves asyncio code from it.

    Use :meth:`add_request` (returns a :class:`RequestStream` once the engine core accepted
    the request) or :meth:`generate` (the same as one async iterator).

    :param make_core: builds the engine core inside the child (a picklable module-level
        function; tests pass one that injects faults)
    :raises EngineStartupError: the engine core failed to start (its message says why)
    """

    def __init__(
        self,
        args: EngineArgs,
        on_finished: Callable[[RequestOutput], None] | None = None,
        make_core: Callable[[EngineArgs], EngineCore] = build_engine_core,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        on_outputs: Callable[[list[RequestOutput]], None] | None = None,
    ):
        self._on_finished = on_finished
        self._on_outputs = on_outputs  # every step's outputs, as they arrive (inter-token latency)
        self._lock = threading.Lock()  # guards _streams, _acks, _outputs, _dead
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._streams: dict[str, RequestStream] = {}
        self._acks: dict[str, concurrent.futures.Future] = {}
        self._dead: BaseException | None = None
        self._shut_down = False
        self._ids = 0
        self.snapshot = EngineSnapshot(scheduler=None)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)
        self._start_process(args, make_core)
        prefetch = _TokenizerPrefetch(args)
        ready = False
        try:
            self.info: EngineInfo = self._wait_ready(startup_timeout)
            ready = True
            logger.info("engine core running in process %d", self.proc.pid)
            self._load_front_end(self.info, prefetch)
        except BaseException:
            # Interrupted or failed start-up: a ready core ignores SIGTERM, so tell it to stop
            # (only then: a PUSH to a core not yet connected would block); one still starting
            # gets SIGTERM at once (it unwinds: a kernel build removes its lock); SIGKILL only
            # if neither ends it.
            if ready:
                self._send(Shutdown())
            self._stop_process(timeout=0.0, term_grace=30.0)
            self._close_sockets()
            raise
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-tokenizer")
        self._thread = threading.Thread(target=self._receive_loop, name="core-outputs", daemon=True)
        self._thread.start()

    def _load_front_end(self, info: EngineInfo, prefetch: _TokenizerPrefetch) -> None:
        """The API side's tokenizers and processors, once the engine core is ready (the
        tokenizers were usually loaded meanwhile, see :class:`_TokenizerPrefetch`)."""
        self.vocab_size = info.vocab_size
        # Two tokenizers: the output thread decodes while the tokenizer thread encodes,
        # and one HF fast tokenizer must not be used from two threads at once.
        self.tokenizer, decoding = prefetch.result((info.tokenizer, info.gguf_file, info.cache_dir))
        self._inputs = InputProcessor(self.tokenizer, info.vocab_size, info.max_model_len)
        self._outputs = OutputProcessor(decoding)

    # ---- the process ----------------------------------------------------------------------
    def _start_process(self, args: EngineArgs, make_core: Callable[[EngineArgs], EngineCore]) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="core-ipc-")
        command_addr = f"ipc://{self._ipc_dir}/commands"
        output_addr = f"ipc://{self._ipc_dir}/outputs"
        self._zmq = zmq.Context()
        self._cmd = self._zmq.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.SNDHWM, 0)  # never block or drop a command
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.bind(command_addr)
        self._out = self._zmq.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.bind(output_addr)
        # spawn: a fresh interpreter (no inherited threads or device state); not a daemon,
        # because a tensor-parallel executor starts worker processes of its own.
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger("core").getEffectiveLevel()
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(args, command_addr, output_addr, os.getpid(), level, make_core),
            name="core-engine-core",
            daemon=False,
        )
        self.proc.start()

    def _wait_ready(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        while True:
            if self._out.poll(int(POLL_S * 1000)):
                msg = self._dec.decode(self._out.recv())
                if isinstance(msg, Ready):
                    return msg.info
                if isinstance(msg, StartupFailed):
                    raise EngineStartupError(f"the engine failed to start: {msg.message}")
            elif not self.proc.is_alive():
                raise EngineStartupError(
                    f"the engine core process (pid {self.proc.pid}) {_exit_description(self.proc.exitcode)} "
                    "during start-up; see the log above for why"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"the engine core did not start within {timeout:.0f} s (still loading?); "
                    "check the log above, or give it longer"
                )

    def _stop_process(self, timeout: float, term_grace: float = 5.0) -> None:
        self.proc.join(timeout)
        for stop, wait in ((self.proc.terminate, term_grace), (self.proc.kill, 5.0)):
            if not self.proc.is_alive():
                break
            stop()
            self.proc.join(wait)

    def _close_sockets(self) -> None:
        with self._send_lock:
            self._cmd.close(linger=0)
        self._out.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _send(self, command: Any) -> None:
        """Queue ``command`` for the engine core, never blocking: a PUSH socket with no
        connected peer (the core exited or is exiting) would block forever. Such a command
        is dropped; the output thread's death detection then fails whoever waits on it."""
        data = self._enc.encode(command)
        with self._send_lock:
            if self._cmd.closed:
                return
            try:
                self._cmd.send(data, flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.debug("engine core not connected; dropped %s", type(command).__name__)

    # ---- public API (any thread / event loop) ---------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        exact_max_tokens: bool = False,
    ) -> RequestStream:
        """Tokenize and check the request, hand it to the engine core, and return its stream
        once the engine core has accepted it. ``exact_max_tokens``: refuse a ``max_tokens``
        that does not fit beside the prompt instead of capping it (see InputProcessor)."""
        request_id = request_id or self._next_id()
        if arrival_time is None:  # now: TTFT and the front-end time include the tokenizer pool's queue
            arrival_time = time.monotonic()
        loop = asyncio.get_running_loop()
        with self._lock:
            self._raise_if_dead()
            self._raise_if_taken(request_id)
        req, text = await loop.run_in_executor(
            self._tokenizer_pool, self._inputs.process, request_id, prompt, params, priority, arrival_time,
            exact_max_tokens,
        )
        stream = RequestStream(request_id, loop, self.abort)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_dead()
            self._raise_if_taken(request_id)
            self._streams[request_id] = stream  # before the add: no output can be missed
            self._acks[request_id] = fut
            self._outputs.add_request(req, text)
        self._send(AddRequest(req))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            refused = fut.done() and not fut.cancelled() and fut.exception() is not None
            if not refused:  # cancelled while waiting: the add may have run; the abort follows it
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
        """Abort a request (thread-safe, non-blocking): it finishes here now with reason
        'abort', and the engine core frees its blocks before its next step."""
        with self._lock:
            out = self._outputs.abort(request_id)
            stream = self._streams.pop(request_id, None)
            self._acks.pop(request_id, None)
            dead = self._dead is not None
        if out is not None:
            self._report_finished(out)
            if stream is not None:
                stream.put(out)
        if not dead:
            self._send(AbortRequests([request_id]))

    async def call(self, fn: Callable[[AsyncLLMEngine], T]) -> T:
        """Run ``fn(self)`` on the tokenizer thread (for ``self.tokenizer``, which is not safe
        to share between threads, e.g. chat templates) and return its result."""
        with self._lock:
            self._raise_if_dead()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, self)

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine core died or was shut down."""
        with self._lock:
            self._raise_if_dead()
        if not self.proc.is_alive():
            raise EngineDeadError(self._death_message())

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or not self.proc.is_alive()

    def num_open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine core (idempotent); consumers still waiting get
        :class:`EngineDeadError`. The process gets ``timeout`` seconds, then is terminated."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        if self.proc.is_alive():
            self._send(Shutdown())
        self._stop_process(30.0 if timeout is None else timeout)
        self._thread.join(10.0)
        self._die(EngineDeadError("the engine was shut down"))
        self._tokenizer_pool.shutdown(wait=False)
        self._close_sockets()

    # ---- output thread --------------------------------------------------------------------
    def _receive_loop(self) -> None:
        try:
            while self._dead is None:
                if self._out.poll(int(POLL_S * 1000)):
                    self._handle(self._dec.decode(self._out.recv()))
                elif not self.proc.is_alive():
                    self._die(EngineDeadError(self._death_message()))
        except Exception as e:  # noqa: BLE001 - a bug here must not leave consumers hanging
            logger.exception("the output thread failed")
            self._die(EngineDeadError(f"the engine front end failed: {e!r}; restart the server"))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            with self._lock:
                outputs, stops = self._outputs.process(msg.deltas)
                finished = [o for o in outputs if o.finished]
                targets = [self._stream_for(o) for o in outputs]
                self._publish(msg.stats)
            self._report_outputs(outputs)  # before on_finished, which forgets the request
            for out in finished:
                self._report_finished(out)
            RequestStream.put_all([(stream, out) for stream, out in zip(targets, outputs) if stream is not None])
            for hit in stops:
                self._send(StopSample(hit.request_id, hit.index))
        elif isinstance(msg, Acks):
            self._acknowledge(msg)
        elif isinstance(msg, Stats):
            with self._lock:
                self._publish(msg.stats)
        elif isinstance(msg, Dead):
            self._die(EngineDeadError(f"{msg.message}; restart the server"))

    def _stream_for(self, out: RequestOutput) -> RequestStream | None:
        if out.finished:
            return self._streams.pop(out.request_id, None)
        return self._streams.get(out.request_id)

    def _acknowledge(self, acks: Acks) -> None:
        with self._lock:
            futs = [(self._acks.pop(rid, None), None) for rid in acks.accepted]
            for r in acks.refused:
                self._outputs.discard(r.request_id)
                self._streams.pop(r.request_id, None)
                exc = EngineOverloaded(r.message) if r.kind == "overloaded" else ValueError(r.message)
                futs.append((self._acks.pop(r.request_id, None), exc))
        for fut, exc in futs:
            if fut is None:
                continue
            try:
                fut.set_result(None) if exc is None else fut.set_exception(exc)
            except concurrent.futures.InvalidStateError:
                pass  # the caller gave up (cancelled) first; its abort is on the way

    def _publish(self, stats: Any) -> None:
        c = self._outputs.counters
        self.snapshot = EngineSnapshot(stats, c.prompt_tokens, c.generation_tokens)

    def _report_finished(self, out: RequestOutput) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(out)
            except Exception:  # metrics must never take the engine down
                logger.exception("on_finished callback failed for %s", out.request_id)

    def _report_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._on_outputs is not None and outputs:
            try:
                self._on_outputs(outputs)
            except Exception:  # metrics must never take the engine down
                logger.exception("on_outputs callback failed")

    def _die(self, exc: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = exc
                if not self._shut_down:
                    logger.error("%s", exc)
            err = self._dead
            streams, self._streams = list(self._streams.values()), {}
            acks, self._acks = list(self._acks.values()), {}
        RequestStream.put_all([(s, err) for s in streams])
        for fut in acks:
            try:
                fut.set_exception(err)
            except concurrent.futures.InvalidStateError:
                pass

    def _death_message(self) -> str:
        if self._shut_down:
            return "the engine was shut down"
        return (
            f"the engine core process (pid {self.proc.pid}) {_exit_description(self.proc.exitcode)}; "
            "every open request failed; restart the server"
        )

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _raise_if_taken(self, request_id: str) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique")

    def _next_id(self) -> str:
        with self._lock:
            self._ids += 1
            return f"async-{self._ids}"


def _exit_description(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
