"""The engine core in its own process, spoken to over ZeroMQ with MessagePack (msgspec).

Two PUSH/PULL pipes, both bound by the front end (the parent) on ``ipc://`` paths:
commands in (:data:`Command`), messages out (:data:`Message`). The child's loop:

1. read every queued command (block, with a timeout, only while idle: no request and no
   step in flight); answer the adds of the batch with one :class:`Acks`;
2. if there is work: ``EngineCore.step()`` and send its deltas with the scheduler's stats.
   With asynchronous scheduling that call launches step N+1 first and only then waits for
   step N's tokens, so the device runs step N+1 while this process updates with step N,
   sends its deltas, reads the next commands and schedules step N+2. Commands (aborts,
   stops) therefore act from the next launched step on; tokens of a request aborted or
   stopped meanwhile are dropped by the scheduler, never sent.

Start-up sends :class:`Ready` or :class:`StartupFailed` (the error's message, so the user
sees why, never a hang). A failing step sends :class:`Dead` and exits 1. The child ignores
SIGINT/SIGTERM (the parent owns the shutdown and its grace period) and exits on its own
when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

import msgspec
import zmq

from core.engine_args import EngineArgs
from core.engine_core.core import EngineCore, EngineOverloaded
from core.engine_core.types import EngineInfo, EngineRequest, RequestDelta
from core.entrypoints.heap import freeze_startup_heap
from core.entrypoints.signals import exit_on_sigterm
from core.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500
"""How often an idle engine core checks its parent and its executor's workers."""


# ---- commands to the engine core ---------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class StopSample(msgspec.Struct, tag="stop", array_like=True):
    """The front end found a stop string in a sample's text: finish that sample."""

    request_id: str
    index: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = AddRequest | AbortRequests | StopSample | Shutdown


# ---- messages from the engine core -------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str
    """What was wrong and what to change (the exception's own message)."""


class Refusal(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    kind: str
    """'invalid' (a ValueError: HTTP 400) or 'overloaded' (EngineOverloaded: HTTP 503)."""
    message: str


class Acks(msgspec.Struct, tag="acks", array_like=True):
    """The answers to the AddRequest commands of one command batch."""

    accepted: list[str]
    refused: list[Refusal]


class StepOutputs(msgspec.Struct, tag="out", array_like=True):
    deltas: list[RequestDelta]
    stats: SchedulerStats


class Stats(msgspec.Struct, tag="stats", array_like=True):
    """The scheduler's numbers after a command batch that changed them (e.g. aborts)."""

    stats: SchedulerStats


class Dead(msgspec.Struct, tag="dead", array_like=True):
    message: str


Message = Ready | StartupFailed | Acks | StepOutputs | Stats | Dead


def build_engine_core(args: EngineArgs) -> EngineCore:
    """The default factory: what ``LLMEngine.from_args`` builds, minus the front end."""
    return EngineCore.from_args(args)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---- the child ---------------------------------------------------------------------------------
def run_engine_core(
    args: EngineArgs,
    command_addr: str,
    output_addr: str,
    parent_pid: int,
    log_level: int,
    make_core: Callable[[EngineArgs], EngineCore] = build_engine_core,
) -> None:
    """The engine-core process's main function (the target of a spawned Process)."""
    # SIGINT (a terminal's Ctrl-C reaches the whole process group) is the front end's to
    # handle. SIGTERM during start-up unwinds cleanly (a kernel build in progress removes its
    # lock and stops its compilers); once serving, the front end owns shutdown and its grace
    # period, so the core then ignores SIGTERM and stops when told to.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_on_sigterm()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)  # let the last message (Dead, StartupFailed) get out
    out.connect(output_addr)
    enc = msgspec.msgpack.Encoder()
    code = 0
    started = threading.Event()
    threading.Thread(target=_exit_if_orphaned, args=(parent_pid, started), name="core-orphan-watch",
                     daemon=True).start()
    try:
        try:
            core = make_core(args)
        except BaseException as e:  # noqa: BLE001 - any start-up failure goes to the user
            logger.debug("engine core start-up failed:\n%s", traceback.format_exc())
            out.send(enc.encode(StartupFailed(_describe(e))))
            code = 1
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        freeze_startup_heap()
        out.send(enc.encode(Ready(core.info(os.getpid()))))
        started.set()  # from here the loop itself notices a vanished parent
        code = _Loop(core, commands, out, parent_pid).run()
    finally:
        commands.close(linger=0)
        out.close()
        ctx.term()
        sys.stdout.flush()
        os._exit(code)  # skip interpreter teardown of torch/executor threads


def _exit_if_orphaned(parent_pid: int, started: threading.Event) -> None:
    """While the model loads (or waits for a kernel build), nothing else would notice that
    the front end died: exit then rather than load for nobody and linger forever."""
    while not started.wait(IDLE_POLL_MS / 1000):
        if os.getppid() != parent_pid:
            logger.warning("the front end (pid %d) is gone during start-up; the engine core exits", parent_pid)
            os._exit(0)


class _Loop:
    def __init__(self, core: EngineCore, commands: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.core = core
        self.commands = commands
        self.out = out
        self.parent_pid = parent_pid
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(Command)

    def run(self) -> int:
        """Serve until told to shut down (0), orphaned (0) or broken (1)."""
        try:
            while True:
                if os.getppid() != self.parent_pid:  # also while busy: one cheap syscall
                    raise _Orphaned()
                busy = self.core.has_unfinished_requests()
                stop = self._commands(block=not busy)
                if stop:
                    self.core.shutdown()
                    return 0
                if self.core.has_unfinished_requests():
                    # async: launch N+1, then collect N (see the module docstring)
                    deltas = self.core.step()
                    self.out.send(self.enc.encode(StepOutputs(deltas, self.core.stats())))
        except _Orphaned:
            logger.warning("the front end (pid %d) is gone; the engine core exits", self.parent_pid)
            self._shutdown_quietly()
            return 0
        except BaseException as e:  # noqa: BLE001 - a failed step kills the engine; say why
            logger.exception("engine core loop failed; the engine is dead")
            self.out.send(self.enc.encode(Dead(f"the engine core failed: {_describe(e)}")))
            self._shutdown_quietly()
            return 1

    def _shutdown_quietly(self) -> None:
        """Stop the executor's workers (they must not outlive us) whatever state it is in."""
        try:
            self.core.shutdown()
        except Exception:  # noqa: BLE001 - already failing; the workers are daemons anyway
            logger.debug("executor shutdown after failure raised", exc_info=True)

    def _commands(self, block: bool) -> bool:
        """Run every queued command (waiting for the first while ``block``); True on Shutdown."""
        while block and not self.commands.poll(IDLE_POLL_MS):
            self._idle_checks()
        accepted, refused, changed = [], [], False
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            cmd = self.dec.decode(raw)
            if isinstance(cmd, Shutdown):
                return True
            changed = True
            if isinstance(cmd, AddRequest):
                refusal = self._add(cmd.request)
                (accepted.append(cmd.request.request_id) if refusal is None else refused.append(refusal))
            elif isinstance(cmd, AbortRequests):
                self.core.abort(cmd.request_ids)
            else:
                self.core.stop_sample(cmd.request_id, cmd.index)
        if accepted or refused:
            self.out.send(self.enc.encode(Acks(accepted, refused)))
        if changed and not self.core.has_unfinished_requests():
            self.out.send(self.enc.encode(Stats(self.core.stats())))  # e.g. after an abort storm
        return False

    def _add(self, req: EngineRequest) -> Refusal | None:
        try:
            self.core.add_request(req)
        except EngineOverloaded as e:
            return Refusal(req.request_id, "overloaded", str(e))
        except ValueError as e:
            return Refusal(req.request_id, "invalid", str(e))
        return None

    def _idle_checks(self) -> None:
        if os.getppid() != self.parent_pid:
            raise _Orphaned()
        self.core.check_health()  # a tensor-parallel worker may have died while idle


class _Orphaned(Exception):
    pass
