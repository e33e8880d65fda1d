"""The in-process executor: the model in the engine's own process, on one device.

It is the executor that launches a step without waiting for it (asynchronous scheduling).
"""

from __future__ import annotations

from core.executor.base import Executor
from core.executor.startup import agree_penalty_state, agree_plans, initialize_runner
from core.kv_plan import KVPlan
from core.model_runner import ModelRunner, ModelRunnerOutput, RunnerSetup
from core.scheduler import SchedulerOutput
from core.step_handle import StepHandle


class UniExecutor(Executor):
    """The model in this process, on one device; ``launch`` returns while the device runs."""

    supports_async_scheduling = True

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int]):
        self.runner = ModelRunner(setup, eos_token_ids)
        self.startup_reports: list = []
        """What :func:`~core.executor.startup.initialize_runner` measured (one entry)."""

    def initialize(self) -> KVPlan:
        self.startup_reports = [initialize_runner(self.runner)]
        self.penalty_state = agree_penalty_state(self.startup_reports)
        return agree_plans(self.startup_reports)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        return self.runner.launch(sched)
