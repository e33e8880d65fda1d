"""EngineCore: the engine loop. ``step()`` is schedule -> execute -> update, nothing else.

With asynchronous scheduling (the default where the executor supports it) one step is in
flight between calls: ``step()`` schedules and launches step N+1 while the device still
runs step N, then waits for step N's tokens and updates with them. The deltas a call
returns are step N's. While a request needs every token on the host before its next step
(``Scheduler.needs_sync()``: a grammar, or penalties where the runner does not keep their
state), the call updates with step N first and then schedules.

It takes tokenized requests and returns per-request token deltas
(:mod:`core.engine_core.types`); it holds no tokenizer state beyond the EOS ids and never
makes text. Not thread-safe: one thread drives it (the offline ``LLMEngine``, or the
engine-core process's loop).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import torch

from core import envs
from core.block_manager import BlockManager
from core.config import EngineConfig
from core.engine_args import EngineArgs
from core.engine_core.resolve import resolve_config
from core.engine_core.types import EngineInfo, EngineRequest, RequestDelta
from core.executor import make_executor
from core.executor.base import Executor
from core.model_runner import RunnerSetup
from core.models import ModelRegistry
from core.ops import Ops
from core.platform import Capability, Platform
from core.plugins import Plugins, load_plugins
from core.pooling import attach_pooled
from core.request import Request
from core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from core.step_handle import ModelRunnerOutput, StepHandle
from core.structured_output.engine import StructuredOutputs
from core.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``); retry later."""


def vocab_size_of(config: EngineConfig, tokenizer) -> int:
    return int(getattr(config.model.hf_config, "vocab_size", 0) or len(tokenizer))


class EngineCore:
    """Owns the executor (model, KV cache), the block manager and the scheduler."""

    def __init__(self, config: EngineConfig, platform: Platform, plugins: Plugins, eos_ids: frozenset[int],
                 vocab_size: int):
        self.config = config
        self.platform = platform
        self.vocab_size = vocab_size
        platform.seed_everything(config.model.seed)
        self.executor = self._make_executor(plugins, eos_ids)
        try:
            self.async_scheduling = self._async_scheduling()
            """Whether ``step`` pipelines (may be switched between steps)."""
        except ValueError:
            self.executor.shutdown()
            raise
        self.kv_plan = self.executor.initialize()
        self._warn_if_oversubscribed()
        c = config.cache
        self.block_manager = BlockManager(
            self.kv_plan.num_blocks, c.block_size, c.enable_prefix_caching, self.kv_plan.num_host_blocks,
            sliding_window=self.kv_plan.sliding_window,
        )
        self.pipeline_depth = self.executor.max_in_flight
        """Micro-batches kept in flight (pipeline parallelism: one per stage)."""
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos_ids,
                                   max_in_flight=self.pipeline_depth,
                                   penalty_state=self.executor.penalty_state)
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self._pipeline: deque[tuple[SchedulerOutput, StepHandle]] = deque()
        m = config.model
        caps = platform.capabilities
        self.structured = StructuredOutputs(lambda: load_tokenizer(m.tokenizer, m.gguf_file, m.cache_dir),
                                            vocab_size, eos_ids, pin_memory=Capability.PINNED_HOST_MEMORY in caps
                                            and Capability.DEVICE_MEMORY in caps)

    @classmethod
    def from_args(cls, args: EngineArgs, plugins: Plugins | None = None) -> EngineCore:
        config, platform, plugins = load_platform_and_config(args, plugins)
        tokenizer = load_tokenizer(config.model.tokenizer, config.model.gguf_file, config.model.cache_dir)
        eos = eos_token_ids(tokenizer, config.model.hf_config)
        return cls(config, platform, plugins, eos, vocab_size_of(config, tokenizer))

    def _make_executor(self, plugins: Plugins, eos_ids: frozenset[int]) -> Executor:
        extra = plugins.attention_backends(self.platform.name)
        requested = self.config.attention_backend
        setup = RunnerSetup(
            config=self.config,
            platform=self.platform,
            ops=Ops({**self.platform.ops(), **plugins.op_overrides(self.platform.name, self.config)}),
            registry=ModelRegistry(plugins.model_architectures()),
            attention_backend_cls=extra.get(requested) if requested else None,
        )
        return make_executor(setup, eos_ids)

    def _async_scheduling(self) -> bool:
        wanted = self.config.async_scheduling
        able = self.executor.supports_async_scheduling
        if wanted and not able:
            p = self.config.parallel
            raise ValueError(
                f"--async-scheduling needs an executor that launches a step before the previous "
                f"one is read back; the {p.executor!r} executor with tensor_parallel_size "
                f"{p.tensor_parallel_size} runs steps synchronously. Drop --async-scheduling "
                "(the default picks what the executor supports)"
            )
        return able if wanted is None else wanted

    def _warn_if_oversubscribed(self) -> None:
        """max_num_seqs x max_model_len may exceed the cache: legal and common (most sequences
        are short, and a one-prompt run never comes near it), so DEBUG, with the numbers for
        whoever investigates preemptions under load."""
        plan, want = self.kv_plan, self.config.scheduler.max_num_seqs
        if plan.max_concurrent_at_max_len < want:
            logger.debug(
                "max_num_seqs %d x max_model_len %d would need %d KV blocks; the cache holds %d "
                "(%d sequences at full length). Longer sequences will wait or be preempted; to run "
                "all at full length raise --kv-cache-memory (or --gpu-memory-utilization) or lower "
                "--max-num-seqs / --max-model-len",
                want, plan.max_model_len, want * plan.blocks_per_max_len_seq,
                plan.num_blocks - 1, plan.max_concurrent_at_max_len,
            )

    def info(self, pid: int) -> EngineInfo:
        m, s = self.config.model, self.config.scheduler
        return EngineInfo(
            model=m.model, tokenizer=m.tokenizer, gguf_file=m.gguf_file, cache_dir=m.cache_dir,
            architecture=m.architecture, max_model_len=m.max_model_len, max_num_seqs=s.max_num_seqs,
            vocab_size=self.vocab_size, num_blocks=self.block_manager.num_usable_blocks,
            block_size=self.block_manager.block_size, disable_log_stats=self.config.disable_log_stats, pid=pid,
        )

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a tokenized, validated request.

        :raises EngineOverloaded: ``max_waiting_requests`` requests are already waiting.
        :raises ValueError: the request can never fit this cache or these limits, or its id
            is in use.
        """
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and self.scheduler.stats().num_waiting + self.structured.num_parked >= limit:
            raise EngineOverloaded(
                f"{limit} requests are already waiting (--max-waiting-requests {limit}); retry later"
            )
        if self.scheduler.get_request(req.request_id) is not None or self.structured.is_parked(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use; ids must be unique")
        request = Request(req.request_id, req.prompt_token_ids, req.params, priority=req.priority,
                          arrival_time=req.arrival_time, received_time=time.monotonic())
        for s in request.seqs:
            s.arrival_time = req.arrival_time
        if req.params.structured is None:
            self.scheduler.add_request(request)
            return
        reason = self.scheduler._never_fits(request)  # refused now, not once its grammar compiled
        if reason is not None:
            raise ValueError(reason)
        self.structured.admit(request, self.scheduler.add_request)

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests now and free their blocks (unknown or finished ids are ignored)."""
        for rid in request_ids:
            self.scheduler.abort_request(rid)
            self.structured.forget(rid)

    def stop_sample(self, request_id: str, index: int) -> None:
        """Finish one sample that the front end stopped (a stop string in its text)."""
        self.scheduler.stop_sample(request_id, index)

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One step: schedule -> execute -> update; with asynchronous scheduling, schedule
        and launch the next step, then update with the one launched by the previous call.
        Requests whose grammar finished compiling join the scheduler first; a step with a
        constrained row runs after the step in flight is known (Scheduler.needs_sync), since
        its token mask follows the tokens so far."""
        deltas = self._release_compiled() if self.structured.has_parked() else []
        if self.pipeline_depth > 1:
            return deltas + self._step_pipelined()
        if not self.async_scheduling:
            deltas += self.drain()  # a step launched before the loop was switched to sync
            sched = self._schedule()
            return deltas + self._update(sched, self.executor.execute(sched))
        if self.scheduler.needs_sync():
            deltas += self.drain()
        previous, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            sched = self._schedule()
            self._in_flight = (sched, self.executor.launch(sched))
        if previous is not None:
            deltas += self._update(previous[0], previous[1].result())
        return deltas

    def _step_pipelined(self) -> list[RequestDelta]:
        """Pipeline parallelism: launch a new micro-batch while fewer than
        ``pipeline_depth`` are in flight (the scheduler leaves out sequences whose token is
        still in flight, so micro-batches hold different sequences); update with the
        oldest once the pipe is full or nothing new could be scheduled."""
        launched = False
        deltas: list[RequestDelta] = []
        if len(self._pipeline) < self.pipeline_depth and self.scheduler.has_unfinished_requests():
            sched = self._schedule()
            if _has_work(sched):
                self._pipeline.append((sched, self.executor.launch(sched)))
                launched = True
            else:  # nothing to run now; still report aborts
                deltas += self._update(sched, ModelRunnerOutput({}, {}))
        if self._pipeline and (not launched or len(self._pipeline) >= self.pipeline_depth):
            sched, handle = self._pipeline.popleft()
            deltas += self._update(sched, handle.result())
        return deltas

    def drain(self) -> list[RequestDelta]:
        """Update with the steps in flight, if any (their deltas; [] when none)."""
        deltas: list[RequestDelta] = []
        while self._pipeline:
            sched, handle = self._pipeline.popleft()
            deltas += self._update(sched, handle.result())
        if self._in_flight is None:
            return deltas
        (sched, handle), self._in_flight = self._in_flight, None
        return deltas + self._update(sched, handle.result())

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        grammar = self.structured.step_bitmask(sched, self.scheduler) if self.structured.active else None
        return dataclasses.replace(sched, grammar=grammar) if grammar is not None else sched

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestDelta]:
        deltas = self.scheduler.update(sched, result)
        if result.pooled:
            deltas = attach_pooled(deltas, sched, result.pooled)
        self.structured.accept(deltas)
        return deltas

    def _release_compiled(self) -> list[RequestDelta]:
        """Requests whose grammar compiled join the scheduler (structured output)."""
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None and not self._pipeline:
            self.structured.wait_for_compile()  # nothing else to run: do not spin
        return self.structured.release_ready(self.scheduler.add_request)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished, waits for its grammar, or a step is in flight."""
        return (self._in_flight is not None or bool(self._pipeline)
                or self.scheduler.has_unfinished_requests() or self.structured.has_parked())

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_health(self) -> None:
        """Raise RuntimeError if a worker of the executor has died."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


def _has_work(sched: SchedulerOutput) -> bool:
    """Whether a schedule needs the executor (sequences to run or KV blocks to move)."""
    return bool(sched.scheduled or sched.blocks_to_copy or sched.blocks_to_swap_in
                or sched.blocks_to_swap_out)


def load_platform_and_config(args: EngineArgs, plugins: Plugins | None = None) -> tuple[EngineConfig, Platform, Plugins]:
    """Load plugins, pick and build the platform, resolve the config (reads the environment)."""
    env = envs.read()
    plugins = plugins or load_plugins(env.no_plugin_autoload, env.plugins)
    info = plugins.select(args.platform or env.platform)
    platform = info.cls()
    if env.num_threads and platform.shares_host_memory():
        torch.set_num_threads(env.num_threads)
    plugins.register_model_configs()  # before the checkpoint's config.json is read
    config = resolve_config(args, platform, env.cache_dir, plugins)
    logger.info("platform %s (%s); model %s (%s, %s)", platform.name, info.probe.reason,
                config.model.model, config.model.architecture, config.model.dtype)
    return config, platform, plugins
