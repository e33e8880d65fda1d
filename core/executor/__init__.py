"""Execution: where the model runs, one module per concept, siblings side by side.

* :mod:`~core.executor.base` - the :class:`Executor` interface the engine core drives;
* :mod:`~core.executor.uni` - in this process; :mod:`~core.executor.multiproc` - one
  process per rank on this host; :mod:`~core.executor.ray_executor` - Ray actors placed
  over the nodes of a cluster;
* :mod:`~core.executor.worker` - one rank's work, the same in a process and an actor;
* :mod:`~core.executor.startup` - the one start-up path of every executor (memory
  profile, KV plan, agreement across ranks, allocation);
* :mod:`~core.executor.distributed` - the communicators (collectives, stage links);
* :mod:`~core.executor.pipeline` - pipeline stages (layer split, a stage's step);
* :mod:`~core.executor.parallel_check` - refusing sizes that cannot work, at start.

This module imports nothing at load (model code imports the communicators from here,
and the executors import the model runner): :func:`make_executor` imports lazily.
"""

from __future__ import annotations


def make_executor(setup, eos_token_ids: frozenset[int]):
    """The executor ``setup.config.parallel`` asks for: in-process for one rank under
    ``auto``/``uni``, else ``mp`` (``auto`` means ``mp``) or ``ray``."""
    par = setup.config.parallel
    if par.world_size == 1 and par.executor in ("auto", "uni"):
        from core.executor.uni import UniExecutor

        return UniExecutor(setup, eos_token_ids)
    if par.executor in ("auto", "mp"):
        from core.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(setup, eos_token_ids)
    if par.executor == "ray":
        from core.executor.ray_executor import RayExecutor

        return RayExecutor(setup, eos_token_ids)
    raise ValueError(
        f"executor {par.executor!r} cannot run --tensor-parallel-size "
        f"{par.tensor_parallel_size} x --pipeline-parallel-size "
        f"{par.pipeline_parallel_size}; use mp (one host) or ray"
    )
