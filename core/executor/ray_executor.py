"""The Ray executor: one Ray actor per rank (``tp x pp``), placed by a placement group
with one bundle per pipeline stage, so that a tensor-parallel group stays inside one node
and the stages spread over the nodes of a cluster.

The driver (the engine's process) keeps the scheduler; each actor runs a
:class:`~core.executor.worker.Worker`. Ray is an optional dependency
(``pip install 'core[ray]'``), imported only when this executor is built. See
docs/distributed.md.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from typing import Any

from core.executor.base import Executor, refusal
from core.executor.startup import StartupReport, agree_penalty_state, agree_plans
from core.executor.worker import (
    ROOT_CAUSE_WAIT_S,
    Worker,
    WorkerError,
    WorkerSpec,
    last_line,
    output_rank,
    remote_failure,
)
from core.kv_plan import KVPlan
from core.model_runner import ModelRunnerOutput, RunnerSetup
from core.scheduler import SchedulerOutput
from core.step_handle import StepHandle

logger = logging.getLogger(__name__)

RAY_PLACEMENT_TIMEOUT_S = 120.0
"""How long the executor waits for the cluster to grant its placement group."""
RAY_HEALTH_TIMEOUT_S = 10.0
"""How long check_health waits for each actor's answer."""

def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            "--executor ray needs Ray: pip install 'core[ray]' (or pip install ray), on every "
            "node of the cluster"
        ) from None
    return ray


def ray_resource(platform) -> str:
    """The Ray resource one rank's bundle asks for on ``platform``."""
    return platform.ray_resource()


class RayWorkerActor:
    """The body of a rank's Ray actor (wrapped with ``ray.remote`` by the executor)."""

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int]):
        self.setup, self.eos_token_ids = setup, eos_token_ids
        self.worker: Worker | None = None

    def node(self) -> tuple[str, str, int]:
        """(node id, node IP, devices of the platform this actor sees)."""
        import ray

        visible = 0 if self.setup.platform.shares_host_memory() else self.setup.platform.device_count()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), visible

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, spec: WorkerSpec) -> StartupReport:
        self.worker = Worker(self.setup, self.eos_token_ids, spec)
        return self.worker.initialize()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute(sched)

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        return True


class _RayGroup:
    """The actors and placement group of one executor; ``close`` releases them. Kept apart
    from the executor so that a finalizer can release them without keeping it alive."""

    def __init__(self, ray, owns_ray: bool):
        self.ray, self.owns_ray = ray, owns_ray
        self.actors: list[Any] = []
        self.pg = None

    def kill_actors(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already dead, or Ray already shut down
                pass

    def close(self) -> None:
        if not self.ray.is_initialized():
            return
        self.kill_actors()
        if self.pg is not None:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster may already be gone
                pass
        if self.owns_ray:
            self.ray.shutdown()


class RayExecutor(Executor):
    """One Ray actor per rank, placed with a placement group of one bundle per pipeline
    stage, ``{resource: tp}`` each: a bundle lives on one node, so a tensor-parallel group
    (all-reduces every layer) never crosses nodes; strategy SPREAD puts the stages on
    different nodes where the cluster has them (only activations cross between stages).

    Uses the cluster Ray is already connected to in this process; otherwise
    ``ray.init(address=--ray-address)`` (None: ``RAY_ADDRESS``, or a cluster running on this
    host, or a new local one, which this executor then shuts down with itself). Each
    schedule is stored once in Ray's object store and passed by reference to every actor.
    """

    def __init__(self, setup: RunnerSetup, eos_token_ids: frozenset[int]):
        ray = self._ray = _import_ray()
        par = setup.config.parallel
        self.world_size = par.world_size
        self.tp, self.pp = par.tensor_parallel_size, par.pipeline_parallel_size
        self.max_in_flight = self.pp
        self._output_rank = output_rank(self.world_size, self.pp)
        self.startup_reports: list = []
        """Every rank's :class:`~core.executor.startup.StartupReport`, by rank."""
        self.nodes: list[str] = []
        """Ray node id of each rank's actor, by rank (after ``initialize``)."""
        self._platform = setup.platform
        self._failure: BaseException | None = None
        owns = not ray.is_initialized()
        if owns:
            ray.init(address=par.ray_address)
        self._group = _RayGroup(ray, owns)
        self._stop = weakref.finalize(self, self._group.close)
        try:
            self._group.pg = self._place()
            self._group.actors.extend(self._spawn(setup, eos_token_ids))
        except BaseException:
            self.shutdown()
            raise

    @property
    def workers(self) -> list[Any]:
        """Actor handles by rank."""
        return list(self._group.actors)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the actors by rank (they may live on other hosts)."""
        pings = [a.pid.options(concurrency_group="health").remote() for a in self.workers]
        return self._ray.get(pings, timeout=RAY_HEALTH_TIMEOUT_S)

    def initialize(self) -> KVPlan:
        nodes = self._gather([a.node.remote() for a in self.workers])
        port = self._gather([self.workers[0].free_port.remote()])[0]
        init_method = f"tcp://{nodes[0][1]}:{port}"
        seen: dict[str, int] = {}
        starts = []
        for rank, (node_id, _, visible) in enumerate(nodes):
            local_rank = seen[node_id] = seen.get(node_id, -1) + 1
            # Ray shows a GPU actor only its own device; otherwise pick by local rank.
            index = local_rank if visible > 1 else 0
            spec = WorkerSpec(rank, self.world_size, index, init_method,
                              pipeline_parallel_size=self.pp)
            starts.append(self.workers[rank].start.remote(spec))
        self.startup_reports = self._gather(starts)
        self.nodes = [node_id for node_id, _, _ in nodes]
        logger.info("%d Ray actors (%d stage(s) of %d) on %d node(s)",
                    self.world_size, self.pp, self.tp, len(seen))
        self.penalty_state = agree_penalty_state(self.startup_reports)
        return agree_plans(self.startup_reports)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(sched).result()

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Queue the step on every actor (each runs its calls in order); the handle waits
        for all of them and returns the output rank's result."""
        self._raise_if_failed()
        ref = self._ray.put(sched)
        return _RayStep(self, [a.execute.remote(ref) for a in self.workers])

    def _result(self, refs: list[Any]) -> ModelRunnerOutput:
        self._raise_if_failed()
        return self._gather(refs)[self._output_rank]

    def check_health(self) -> None:
        """Raise if the executor failed or an actor is dead or silent (any thread)."""
        self._raise_if_failed()
        ray = self._ray
        pings = [a.ping.options(concurrency_group="health").remote() for a in self.workers]
        for rank, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=RAY_HEALTH_TIMEOUT_S)
            except ray.exceptions.RayActorError as e:
                raise self._death(rank, e) from None
            except ray.exceptions.GetTimeoutError:
                raise WorkerError(
                    f"rank {rank}'s Ray actor did not answer a health check "
                    f"within {RAY_HEALTH_TIMEOUT_S:g} s"
                ) from None

    def shutdown(self) -> None:
        """Kill the actors, release the placement group (and a Ray this executor started)."""
        self._stop()

    # ---- internals -----------------------------------------------------------------------
    def _place(self) -> Any:
        """Create the placement group; refuse with the numbers when the cluster is too small
        in all or when no node can hold one stage's tensor-parallel group."""
        from ray.util.placement_group import placement_group

        ray, n, tp = self._ray, self.world_size, self.tp
        resource = ray_resource(self._platform)
        have = ray.cluster_resources().get(resource, 0)
        sizes = f"--tensor-parallel-size {tp} x --pipeline-parallel-size {self.pp}"
        if have < n:
            raise ValueError(
                f"{sizes} needs {n} x {resource} in the Ray cluster, which has {have:g}; add "
                f"nodes (ray start --address=HEAD:6379) or lower the sizes"
            )
        per_node = [node.get("Resources", {}).get(resource, 0) for node in ray.nodes() if node.get("Alive")]
        if per_node and max(per_node) < tp:
            raise ValueError(
                f"{sizes} keeps each stage's {tp} ranks on one node, but no node of the Ray "
                f"cluster has {tp} {resource} (the most on one node is {max(per_node):g}); "
                f"lower --tensor-parallel-size and raise --pipeline-parallel-size instead"
            )
        pg = placement_group([{resource: tp}] * self.pp, strategy="SPREAD")
        try:
            ray.get(pg.ready(), timeout=RAY_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"Ray did not grant {self.pp} bundles of {{{resource!r}: {tp}}} within "
                f"{RAY_PLACEMENT_TIMEOUT_S:g} s although the cluster has {have:g} {resource}; "
                f"other jobs hold them, or no {self.pp} nodes have {tp} free each: free them "
                f"or lower the sizes"
            ) from None
        return pg

    def _spawn(self, setup: RunnerSetup, eos_token_ids: frozenset[int]) -> list[Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        resource = ray_resource(self._platform)
        if resource == "CPU":
            needs: dict[str, Any] = {"num_cpus": 1}
        elif resource == "GPU":
            needs = {"num_cpus": 0, "num_gpus": 1}
        else:
            needs = {"num_cpus": 0, "resources": {resource: 1}}
        # "health" runs pings beside a long step; every other method runs in order.
        actor_cls = ray.remote(concurrency_groups={"health": 1})(RayWorkerActor)
        setup_ref = ray.put(setup)
        return [
            actor_cls.options(
                **needs,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group.pg, placement_group_bundle_index=rank // self.tp
                ),
            ).remote(setup_ref, eos_token_ids)
            for rank in range(self.world_size)
        ]

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results of one call per rank, in rank order; the first failure stops them all."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(self._death(rank, e))
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if isinstance(e.cause, BaseException) else None
                    error = remote_failure(rank, str(e), cause)
                    self._fail(self._root_cause(error, pending, rank_of))
        return [results[r] for r in range(len(refs))]

    def _root_cause(
        self, error: BaseException, pending: list[Any], rank_of: dict[Any, int]
    ) -> BaseException:
        """Like MultiprocExecutor._root_cause: an actor among the ``pending`` calls that
        turns out dead within ROOT_CAUSE_WAIT_S is the cause; other errors become notes."""
        ray = self._ray
        if not pending:
            return error
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WAIT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return self._death(rank_of[ref], e)
            except ray.exceptions.RayTaskError as e:
                error.add_note(f"rank {rank_of[ref]} failed too: {last_line(str(e))}")
        return error

    def _death(self, rank: int, error: BaseException) -> WorkerError:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return WorkerError(
            f"worker rank {rank} (a Ray actor) died: {first}; the engine "
            f"cannot continue and must be restarted"
        )

    def _fail(self, error: BaseException) -> None:
        """Release every actor (survivors may wait in a collective for the lost one) and
        the placement group, then raise."""
        self._failure = error
        self._stop()
        raise error

    def _raise_if_failed(self) -> None:
        if (why := refusal(self._failure, self._stop.alive)) is not None:
            raise WorkerError(why)


class _RayStep(StepHandle):
    """A step queued on every actor; ``result`` gathers it (once)."""

    def __init__(self, executor: RayExecutor, refs: list[Any]):
        self._executor, self._refs = executor, refs
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._result(self._refs)
        return self._output
