"""One start-up path for every executor: load, profile, plan, agree, allocate.

The in-process executor and each rank of the multiprocess and Ray executors run
:func:`initialize_runner`: load this rank's weights (its tensor-parallel shard of its
pipeline stage's layers), profile the largest step's memory where the platform can measure
it, plan the KV cache from the platform's budget, then, with several ranks, take the
element-wise minimum of the block counts over all ranks (the scheduler hands out block ids
that must exist on every rank and every stage), and allocate. The driver then checks that
the plans the ranks report agree (:func:`agree_plans`) and logs each.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from core.attention import shared_sliding_window
from core.config import GiB
from core.executor.distributed import TorchDistributed
from core.kv_plan import KVPlan, plan_kv_cache
from core.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """What a rank measured and decided at start (logged by the driver, compared in tests)."""

    rank: int
    weights_bytes: int
    peak_bytes: int | None
    """The memory profile's peak (weights + activations of the largest step); None when
    the platform cannot measure or a fixed KV size made the profile unnecessary."""
    plan: KVPlan
    penalty_state: bool = False
    """The rank's sampler keeps each penalised sequence's penalty state across steps
    (:mod:`core.sampler.penalties`): the scheduler then sends a sequence's history only when
    it joins, and penalty requests do not make the asynchronous loop wait."""


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


def initialize_runner(runner: ModelRunner, world: TorchDistributed | None = None) -> StartupReport:
    """Load weights, profile the largest step's memory, size the KV cache from the
    platform's budget, agree with the other ranks of ``world`` on the smallest block
    counts (None: this process is the only rank), allocate."""
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
    rank = 0
    if world is not None and world.world_size > 1:
        rank = world.rank
        # The model's own collectives run on runner.device, so the backend reduces there.
        blocks, host = world.min_ints([plan.num_blocks, plan.num_host_blocks], runner.device)
        plan = dataclasses.replace(plan, num_blocks=blocks, num_host_blocks=host)
    runner.allocate_kv_cache(plan.num_blocks, plan.num_host_blocks)
    # The driver logs every rank's plan (agree_plans): one line per rank, not two.
    return StartupReport(rank, weights, peak, plan, runner.sampler.penalty_state)


def agree_plans(reports: Sequence[StartupReport]) -> KVPlan:
    """Log every rank's plan and return the one the scheduler uses; raise if the ranks
    disagree on what the block manager depends on (they took the same minimum, so a
    difference is a bug, not a user error). Bytes per block may differ between pipeline
    stages (they hold different numbers of layers)."""
    def key(p: KVPlan) -> tuple:
        return (p.num_blocks, p.num_host_blocks, p.block_size, p.max_model_len, p.sliding_window)

    for r in reports:
        peak = "not measured" if r.peak_bytes is None else f"{r.peak_bytes / (1 << 20):.1f} MiB"
        logger.info("rank %d: weights %.1f MiB, profiled peak %s; %s",
                    r.rank, r.weights_bytes / (1 << 20), peak, r.plan.describe())
    first = reports[0].plan
    for r in reports[1:]:
        if key(r.plan) != key(first):
            raise RuntimeError(
                f"the ranks' KV plans differ: rank {reports[0].rank} has {key(first)}, rank "
                f"{r.rank} {key(r.plan)} (num_blocks, num_host_blocks, block_size, "
                f"max_model_len, sliding_window); every rank must plan the same cache"
            )
    return first


def agree_penalty_state(reports: Sequence[StartupReport]) -> bool:
    """Whether the runners keep the penalty state (see :class:`StartupReport`). Only the
    output rank samples, but every rank builds its sampler from the same platform and
    kernel, so a difference is a bug, not a user error."""
    first = reports[0]
    for r in reports[1:]:
        if r.penalty_state != first.penalty_state:
            raise RuntimeError(
                f"the ranks' samplers differ: rank {first.rank} keeps the penalty state on the "
                f"device ({first.penalty_state}), rank {r.rank} ({r.penalty_state}); every rank "
                "must build the same sampler"
            )
    return first.penalty_state
