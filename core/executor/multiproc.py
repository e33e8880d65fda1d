"""The multiprocess executor: one spawned worker process per rank (``tp x pp`` of them)
on this host.

Who does what (see docs/distributed.md): the **driver** is the engine's process; it keeps
the scheduler and the block manager, sends every step's
:class:`~core.scheduler.SchedulerOutput` to every worker and waits for the output rank's
:class:`~core.model_runner.ModelRunnerOutput`. It never touches a device and is not a
member of the process group. Each **worker** runs a :class:`~core.executor.worker.Worker`.
With pipeline parallelism ``launch`` returns before the step ran, so the engine core can
put the next micro-batch in the pipe while the stages work on the earlier ones.

Failure: a worker that dies or raises ends the step with a
:class:`~core.executor.worker.WorkerError`
naming the rank (or the worker's own exception, e.g. a ValueError about the KV budget,
with a note naming the rank). The executor then stops every worker, so none is left
waiting in a collective, and stays failed: ``execute`` and ``check_health`` raise from
then on.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import weakref

import torch

from core.executor.base import Executor, refusal
from core.executor.startup import agree_penalty_state, agree_plans
from core.executor.worker import (
    ROOT_CAUSE_WAIT_S,
    Worker,
    WorkerError,
    WorkerSpec,
    error_message,
    last_line,
    output_rank,
    remote_failure,
)
from core.kv_plan import KVPlan
from core.model_runner import ModelRunnerOutput, RunnerSetup
from core.platform import Platform
from core.scheduler import SchedulerOutput
from core.step_handle import StepHandle

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""How long shutdown waits for workers to exit on their own before terminating them."""


# ---- the worker process ----------------------------------------------------------------------------


def _mp_worker_main(
    setup: RunnerSetup,
    eos_token_ids: frozenset[int],
    spec: WorkerSpec,
    conn: multiprocessing.connection.Connection,
    visibility: tuple[str, str] | None,
    parent_pid: int,
) -> None:
    """Entry point of a worker process: start, report ready, then serve schedules.

    Protocol on ``conn``: the driver sends ``(step, SchedulerOutput)`` pickled to bytes,
    and an empty message to stop; the worker sends ``("ready", StartupReport)`` once, then
    (the output rank only) ``("out", step, ModelRunnerOutput)`` per schedule, and ``("error", text,
    exception)`` if anything fails. The step number lets the driver drop the reply of a
    step it stopped waiting for (an interrupted ``execute``).
    """
    if visibility is not None:  # before any device runtime starts in this process
        os.environ[visibility[0]] = visibility[1]
    # Ctrl-C reaches the whole process group; the driver decides how its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    code = 0
    try:
        worker = Worker(setup, eos_token_ids, spec)
        conn.send(("ready", worker.initialize()))
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the driver is gone
                break
            if not data:
                break
            step, sched = pickle.loads(data)
            out = worker.execute(sched)
            if spec.is_output_rank:
                conn.send_bytes(pickle.dumps(("out", step, out), protocol=pickle.HIGHEST_PROTOCOL))
        worker.close()
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit non-zero
        text, exc = error_message(e)
        try:
            conn.send(("error", text, exc))
        except OSError:
            pass
        code = 1
    # Skip the interpreter's teardown of torch and the model (seconds, and nothing in
    # it matters now): the driver waits for this exit at shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit if the driver dies without stopping us (e.g. SIGKILL): no orphaned workers."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_visibility(platform: Platform, rank: int, world_size: int) -> tuple[str, str] | None:
    """(variable, value) that shows worker ``rank`` only its own device, or None when the
    platform has no visibility variable (the worker then uses device index ``rank``).

    The n-th worker gets the n-th device this process may use: the n-th entry of the
    variable when the user set it (ids or UUIDs are passed through), else device n.
    """
    var = platform.device_visibility_env
    if var is None or platform.shares_host_memory():
        return None
    # The one environment read below the entry point: the user's device restriction
    # must be narrowed per worker, and only the platform knows the variable's name.
    given = os.environ.get(var)
    ids = [x.strip() for x in given.split(",") if x.strip()] if given else None
    if ids is not None and rank >= len(ids):
        raise ValueError(
            f"{var}={given!r} lists {len(ids)} device(s) but the engine needs {world_size} "
            f"(--tensor-parallel-size x --pipeline-parallel-size); list more devices or "
            f"lower the sizes"
        )
    return var, ids[rank] if ids is not None else str(rank)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its process ended (exit status not yet known)"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---- the driver's side -----------------------------------------------------------------------------


class MultiprocExecutor(Executor):
    """One spawned process per rank on this host, driven over pipes.

    Schedules travel as one pickle sent to every worker's pipe rather than a
    torch.distributed broadcast: the driver is not in the process group (it holds no
    device), and waiting on pipes together with the processes' exit sentinels notices a
    dead worker at once, where a collective would block until the backend's timeout.
    """

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int]):
        par = setup.config.parallel
        self.world_size = par.world_size
        self.max_in_flight = par.pipeline_parallel_size
        self._output_rank = output_rank(self.world_size, par.pipeline_parallel_size)
        self.startup_reports: list = []
        """Every rank's :class:`~core.executor.startup.StartupReport`, by rank."""
        self._failure: BaseException | None = None
        self._step = 0
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._stop = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = None
        if setup.platform.shares_host_memory():  # the ranks share this host's cores
            threads = max(1, torch.get_num_threads() // self.world_size)
        visible = [worker_visibility(setup.platform, r, self.world_size) for r in range(self.world_size)]
        for rank in range(self.world_size):
            spec = WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                device_index=0 if visible[rank] else rank,
                init_method=init_method,
                num_threads=threads,
                pipeline_parallel_size=par.pipeline_parallel_size,
            )
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_mp_worker_main,
                args=(setup, eos_token_ids, spec, theirs, visible[rank], os.getpid()),
                name=f"core-rank{rank}",
                daemon=True,  # terminated by multiprocessing if the driver exits normally
            )
            try:
                proc.start()
            except BaseException:
                self.shutdown()
                raise
            theirs.close()  # the worker's end lives in the worker only: its death means EOF
            self._procs.append(proc)
            self._conns.append(ours)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids by rank (for operators and tests)."""
        return [p.pid for p in self._procs]

    def initialize(self) -> KVPlan:
        ready = self._collect(set(range(self.world_size)), ("ready",))
        self.startup_reports = [ready[r][0] for r in range(self.world_size)]
        logger.info("%d worker processes, pids by rank: %s", self.world_size, self.worker_pids)
        self.penalty_state = agree_penalty_state(self.startup_reports)
        return agree_plans(self.startup_reports)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(sched).result()

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Send the step to every worker; its handle waits for the output rank's reply.
        Handles must be waited for in launch order (the engine core does)."""
        self._raise_if_failed()
        self._step += 1
        data = pickle.dumps((self._step, sched), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            try:
                conn.send_bytes(data)
            except OSError:  # that worker is gone; _collect reports how (death or error)
                pass
        return _MultiprocStep(self, self._step)

    def _result(self, step: int) -> ModelRunnerOutput:
        self._raise_if_failed()
        return self._collect({self._output_rank}, ("out", step))[self._output_rank][0]

    def check_health(self) -> None:
        """Raise if the executor failed or a worker process is gone (safe from any thread)."""
        self._raise_if_failed()
        for rank, proc in enumerate(self._procs):
            if multiprocessing.connection.wait([proc.sentinel], timeout=0):
                raise self._death(rank)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force); idempotent."""
        self._stop()

    # ---- internals -----------------------------------------------------------------------
    def _collect(self, ranks: set[int], head: tuple) -> dict[int, tuple]:
        """Wait for a message starting with ``head`` from each of ``ranks`` (returns the
        rest of each) while watching every worker: an error report or a finished process
        fails the executor; a reply to an earlier, abandoned step is dropped."""
        results: dict[int, tuple] = {}
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(results) < len(ranks):
            for ready in multiprocessing.connection.wait([*self._conns, *by_sentinel]):
                if isinstance(ready, int):  # a sentinel: that process has ended
                    rank = by_sentinel[ready]
                    if not self._conns[rank].poll():  # read what it said before dying first
                        self._fail(self._death(rank))
                    continue
                rank = by_conn[id(ready)]
                msg = self._receive(rank, ready)
                if msg[0] == "out" and head[0] == "out" and msg[1] < head[1]:
                    continue  # stale
                if rank not in ranks or msg[: len(head)] != head:
                    self._fail(WorkerError(f"rank {rank} sent an unexpected {msg[0]!r} message"))
                results[rank] = msg[len(head) :]
        return results

    def _receive(self, rank: int, conn) -> tuple:
        """The next message from ``rank``; an error report fails the executor."""
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            self._fail(self._death(rank))
        if msg[0] == "error":
            self._fail(self._root_cause(rank, remote_failure(rank, msg[1], msg[2])))
        return msg

    def _root_cause(self, rank: int, error: BaseException) -> BaseException:
        """What to report for ``error`` from ``rank``: a peer that died silently within
        ROOT_CAUSE_WAIT_S is the cause (the collectives of the others fail because of
        it); errors other ranks reported meanwhile are added as notes."""
        others = {p.sentinel: r for r, p in enumerate(self._procs) if r != rank}
        deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
        while others and (left := deadline - time.monotonic()) > 0:
            for sentinel in multiprocessing.connection.wait(list(others), timeout=left):
                other = others.pop(sentinel)
                try:
                    if not self._conns[other].poll():
                        raise EOFError
                    msg = self._conns[other].recv()
                except (EOFError, OSError):
                    return self._death(other)
                if msg[0] == "error":
                    error.add_note(f"rank {other} failed too: {last_line(msg[1])}")
        return error

    def _death(self, rank: int) -> WorkerError:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return WorkerError(
            f"worker rank {rank} (pid {proc.pid}) died: "
            f"{_describe_exit(proc.exitcode)}; the engine cannot continue and must be "
            f"restarted (if it was killed without a reason, check the host's memory: the "
            f"kernel's OOM killer sends SIGKILL)"
        )

    def _fail(self, error: BaseException) -> None:
        """Stop all workers and raise. Survivors may be blocked in a collective waiting for
        the lost rank, so they are terminated rather than asked to stop."""
        self._failure = error
        for proc in self._procs:
            if proc.exitcode is None:
                proc.terminate()
        self._stop()
        raise error

    def _raise_if_failed(self) -> None:
        if (why := refusal(self._failure, self._stop.alive)) is not None:
            raise WorkerError(why)


class _MultiprocStep(StepHandle):
    """A step sent to the workers; ``result`` reads the output rank's reply (once)."""

    def __init__(self, executor: MultiprocExecutor, step: int):
        self._executor, self._step = executor, step
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._result(self._step)
        return self._output


def _stop_processes(procs: list, conns: list) -> None:
    for proc, conn in zip(procs, conns):
        if proc.exitcode is None:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
