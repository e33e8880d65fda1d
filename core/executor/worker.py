"""One rank's work, the same in a worker process and in a Ray actor.

A worker joins the torch.distributed group (backend from
``platform.distributed_backend()``) of ``tp x pp`` ranks and its stage's tensor-parallel
group, builds a :class:`~core.model_runner.ModelRunner` whose parallel layers hold only
its rank's shard of its stage's layers, starts like every executor
(:func:`~core.executor.startup.initialize_runner`: profile, plan, the minimum over all
ranks, allocate), then runs each schedule it is given. The ranks of a stage run the same
forward pass (their collectives meet); only tensor-parallel rank 0 of the last stage
samples, so only its output counts (the *output rank*, global rank ``tp * (pp - 1)``).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import traceback
from dataclasses import dataclass

import torch

from core.executor.distributed import (
    StageLink,
    destroy_torch_distributed,
    init_parallel_groups,
    init_torch_distributed,
)
from core.executor.pipeline import PipelineStage, check_pipeline_support, stage_layers
from core.executor.startup import StartupReport, initialize_runner
from core.model_runner import ModelRunner, ModelRunnerOutput, RunnerSetup
from core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

ROOT_CAUSE_WAIT_S = 2.0
"""After a worker reports an error, how long an executor looks for a rank that died: a
rank's death makes its peers' collectives fail, and the death is the error worth reporting."""


class WorkerError(RuntimeError):
    """A worker (a tensor- or pipeline-parallel rank) died or failed; the engine cannot
    continue (restart it)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Where one rank runs and how it finds the others."""

    rank: int
    world_size: int
    device_index: int
    """Index of this rank's device among the devices its process sees."""
    init_method: str
    """``tcp://HOST:PORT`` where rank 0 listens for the process-group rendezvous."""
    num_threads: int | None = None
    """torch intra-op threads (CPU workers share the host's cores), None: leave as is."""
    pipeline_parallel_size: int = 1
    """Stages; ``world_size // pipeline_parallel_size`` ranks per stage (the TP size)."""

    @property
    def tp(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    @property
    def is_output_rank(self) -> bool:
        """Tensor-parallel rank 0 of the last stage: the rank that samples and answers."""
        return self.rank == output_rank(self.world_size, self.pipeline_parallel_size)


def output_rank(world_size: int, pp: int) -> int:
    """Global rank of tensor-parallel rank 0 of the last pipeline stage."""
    return world_size - world_size // pp


class Worker:
    """One rank: its process-group memberships and its model runner."""

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int], spec: WorkerSpec):
        platform = setup.platform
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        platform.set_device(spec.device_index)
        self.spec = spec
        pp, tp = spec.pipeline_parallel_size, spec.tp
        model_cfg = setup.config.model
        check_pipeline_support(setup.registry.resolve(model_cfg.architecture), model_cfg.architecture, pp)
        init_torch_distributed(platform.distributed_backend(), spec.rank, spec.world_size, spec.init_method)
        self.comm, self.world = init_parallel_groups(spec.rank, tp, pp)
        platform.seed_everything(model_cfg.seed)
        stage = None
        if pp > 1:
            layers = stage_layers(model_cfg.hf_config.num_hidden_layers, pp, spec.rank // tp,
                                  setup.config.parallel.pp_layer_split)
            stage = PipelineStage(layers, StageLink(spec.rank, tp, pp))
        setup = dataclasses.replace(setup, comm=self.comm, device_index=spec.device_index, stage=stage)
        self.runner = ModelRunner(setup, eos_token_ids)

    def initialize(self) -> StartupReport:
        """Load this rank's shard; size the KV cache to the smallest of all ranks' budgets."""
        return dataclasses.replace(initialize_runner(self.runner, self.world), rank=self.spec.rank)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.runner.execute(sched)
        return out if self.spec.is_output_rank else None

    def close(self) -> None:
        stage = self.runner.setup.stage
        if stage is not None:
            stage.link.flush()
        destroy_torch_distributed()


def error_message(exc: BaseException) -> tuple[str, BaseException | None]:
    """(formatted traceback, the exception itself if it survives pickling)."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
        return text, None
    return text, exc


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def remote_failure(rank: int, text: str, exc: BaseException | None) -> BaseException:
    """The exception the driver raises for a worker's exception: the original one (so a
    ValueError stays a ValueError) noting the rank, else a WorkerError with the text."""
    if exc is None:
        return WorkerError(f"parallel rank {rank} failed:\n{text}")
    exc.add_note(f"(raised on parallel rank {rank}; its traceback:)\n{text}")
    return exc
