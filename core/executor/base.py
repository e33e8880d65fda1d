"""The executor interface: where the model runs, behind one small interface so the engine
never changes when execution spreads over processes or hosts.

Its implementations sit beside it in this package: :mod:`~core.executor.uni` (this
process), :mod:`~core.executor.multiproc` (one process per rank on this host) and
:mod:`~core.executor.ray_executor` (Ray actors, several hosts). All of them start the same
way (:mod:`~core.executor.startup`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from core.kv_plan import KVPlan
from core.scheduler import SchedulerOutput
from core.step_handle import DoneStep, ModelRunnerOutput, StepHandle


class Executor(ABC):
    """Runs scheduled steps on one or more workers; the sampled tokens of the output rank
    (tensor-parallel rank 0 of the last pipeline stage) come back."""

    supports_async_scheduling: bool = False
    """``launch`` returns before the step has run, and a decode row may carry the
    placeholder token (its id sampled by the previous step, still on the device). The
    engine core schedules asynchronously only with an executor that says so."""

    max_in_flight: int = 1
    """How many launched steps may be unfinished at once. A pipeline-parallel executor
    says its number of stages: the engine core then keeps that many micro-batches in
    flight (each of different requests), so every stage has work."""

    penalty_state: bool = False
    """Known after :meth:`initialize`: the sampling rank's runner keeps each penalised
    sequence's penalty state across steps (the start-up reports say so,
    :func:`~core.executor.startup.agree_penalty_state`); the engine core tells the scheduler."""

    @abstractmethod
    def initialize(self) -> KVPlan:
        """Load the model on every worker, size the KV cache, allocate it; return the plan."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers."""

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Start one step; its ``result()`` is :meth:`execute`'s output.

        Default: run the step now and return a handle that is already done."""
        return DoneStep(self.execute(sched))

    def check_health(self) -> None:
        """Raise RuntimeError if a worker has died. Default: in-process, always healthy."""

    def shutdown(self) -> None:
        """Stop workers and free resources. Default: nothing to stop."""


def refusal(failure: BaseException | None, alive: bool) -> str | None:
    """Why an executor of worker processes or actors cannot take another call, or None.

    ``failure`` is the error that stopped its workers (a lost rank leaves the survivors
    blocked in a collective, so one failure ends the executor); ``alive`` is false once it
    was shut down."""
    if failure is not None:
        return f"the engine's workers failed earlier: {failure}"
    if not alive:
        return "the executor has been shut down; start a new engine"
    return None
