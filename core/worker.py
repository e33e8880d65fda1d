"""One tensor-parallel rank's work, the same in a worker process and in a Ray actor.

A worker joins the torch.distributed group (backend from
``platform.distributed_backend()``), builds a :class:`~core.model_runner.ModelRunner` whose
parallel layers hold only its rank's shard, sizes its KV cache and agrees with the other
ranks on the smallest block count, then runs each schedule it is given. All ranks run the
same forward pass (their collectives meet); only rank 0 samples, so only its output counts.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import traceback
from dataclasses import dataclass

import torch

from core.distributed import TorchDistributed, destroy_torch_distributed, init_torch_distributed
from core.executor import plan_kv
from core.kv_plan import KVPlan
from core.model_runner import ModelRunner, ModelRunnerOutput, RunnerSetup
from core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

ROOT_CAUSE_WAIT_S = 2.0
"""After a worker reports an error, how long an executor looks for a rank that died: a
rank's death makes its peers' collectives fail, and the death is the error worth reporting."""


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot continue (restart it)."""


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


class Worker:
    """One tensor-parallel rank: its process-group membership and its model runner."""

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int], spec: WorkerSpec):
        platform = setup.platform
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        platform.set_device(spec.device_index)
        self.rank = spec.rank
        self.comm = init_torch_distributed(
            platform.distributed_backend(), spec.rank, spec.world_size, spec.init_method
        )
        platform.seed_everything(setup.config.model.seed)
        setup = dataclasses.replace(setup, comm=self.comm, device_index=spec.device_index)
        self.runner = ModelRunner(setup, eos_token_ids)

    def initialize(self) -> KVPlan:
        """Load this rank's shard; size the KV cache to the smallest of all ranks' budgets."""
        return plan_and_allocate(self.runner, self.comm)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.runner.execute(sched)
        return out if self.rank == 0 else None

    def close(self) -> None:
        destroy_torch_distributed()


def plan_and_allocate(runner: ModelRunner, comm: TorchDistributed) -> KVPlan:
    """Like :func:`core.executor.initialize_runner`, with one collective between planning
    and allocating: every rank must hold the same number of blocks (the scheduler hands
    out block ids for all of them), so all take the minimum."""
    weights = runner.load_model()
    plan = plan_kv(runner, weights)
    # The model's own collectives run on runner.device, so the backend reduces there.
    blocks, host_blocks = comm.min_ints([plan.num_blocks, plan.num_host_blocks], runner.device)
    plan = dataclasses.replace(plan, num_blocks=blocks, num_host_blocks=host_blocks)
    runner.allocate_kv_cache(plan.num_blocks, plan.num_host_blocks)
    logger.info("rank %d: weights %.1f MiB; %s", comm.rank, weights / (1 << 20), plan.describe())
    return plan


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
        return WorkerError(f"tensor-parallel rank {rank} failed:\n{text}")
    exc.add_note(f"(raised on tensor-parallel rank {rank}; its traceback:)\n{text}")
    return exc
