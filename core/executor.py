"""Where the model runs: behind one small interface so the engine never changes when
execution spreads over processes or hosts.

``UniExecutor`` runs the model in this process (tensor-parallel size 1). It is the one that
launches a step without waiting for it (asynchronous scheduling); the distributed executors
keep the default :meth:`Executor.launch`, which runs the step before returning.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from core.attention import shared_sliding_window
from core.config import GiB
from core.kv_plan import KVPlan, plan_kv_cache
from core.model_runner import ModelRunner, ModelRunnerOutput, RunnerSetup
from core.scheduler import SchedulerOutput
from core.step_handle import DoneStep, StepHandle

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Runs scheduled steps on one or more workers; rank 0's sampled tokens come back."""

    supports_async_scheduling: bool = False
    """``launch`` returns before the step has run, and a decode row may carry the
    placeholder token (its id sampled by the previous step, still on the device). The
    engine core schedules asynchronously only with an executor that says so."""

    @abstractmethod
    def initialize(self) -> KVPlan:
        """Load the model on every worker, size the KV cache, allocate it; return the plan."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers."""

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Start one step; its ``result()`` is :meth:`execute`'s output.

        Default: run the step now and return a handle that is already done. The distributed
        executors (mp, ray) use this: their steps are synchronous, so with them the engine
        core schedules each step after the previous one's tokens are known."""
        return DoneStep(self.execute(sched))

    def check_health(self) -> None:
        """Raise RuntimeError if a worker has died. Default: in-process, always healthy."""

    def shutdown(self) -> None:
        """Stop workers and free resources. Default: nothing to stop."""


def plan_kv(runner: ModelRunner, used_bytes: int) -> KVPlan:
    """The KV-cache plan for the platform's budget once ``used_bytes`` (weights, or the
    profiled peak with activations) are taken."""
    cfg = runner.config
    budget = runner.platform.kv_cache_budget(
        cfg.cache.kv_cache_memory, cfg.cache.gpu_memory_utilization, used_bytes
    )
    return plan_kv_cache(
        budget_bytes=budget,
        bytes_per_block=runner.kv_bytes_per_block(),
        block_size=cfg.cache.block_size,
        max_model_len=cfg.model.max_model_len,
        swap_bytes=int(cfg.cache.swap_space * GiB),
        num_blocks_override=cfg.cache.num_blocks_override,
        sliding_window=shared_sliding_window(runner.model.attention_specs()),
        max_step_tokens=cfg.scheduler.max_num_batched_tokens,
    )


def initialize_runner(runner: ModelRunner) -> KVPlan:
    """Load weights, profile the largest step's memory, size the KV cache from the
    platform's budget, allocate it."""
    cfg = runner.config
    weights = runner.load_model()
    needs_budget = cfg.cache.kv_cache_memory is None and cfg.cache.num_blocks_override is None
    peak = runner.profile_run() if needs_budget else None
    if peak is not None:
        logger.info(
            "memory profile: weights %.1f MiB, peak with activations of the largest step "
            "%.1f MiB", weights / (1 << 20), peak / (1 << 20),
        )
    plan = plan_kv(runner, max(weights, peak or 0))
    runner.allocate_kv_cache(plan.num_blocks, plan.num_host_blocks)
    logger.info("weights: %.1f MiB; %s", weights / (1 << 20), plan.describe())
    return plan


class UniExecutor(Executor):
    """The model in this process, on one device; ``launch`` returns while the device runs."""

    supports_async_scheduling = True

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int]):
        self.runner = ModelRunner(setup, eos_token_ids)

    def initialize(self) -> KVPlan:
        return initialize_runner(self.runner)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        return self.runner.launch(sched)
