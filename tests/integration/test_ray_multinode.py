"""The Ray executor on a local multi-node Ray cluster (three raylets on 127.0.0.1, as Ray's
own tests do with ``ray.cluster_utils.Cluster``), joined through ``--ray-address``:

* PP=2 and PP=3 put their stages on different nodes; TP=2 x PP=2 keeps each tensor-parallel group
  on one node and the two stages on different nodes; both give the greedy tokens of the
  in-process TP=1 engine through batching, chunked prefill and preemption;
* a tensor-parallel group larger than any node is refused with the numbers;
* the last stage's actor killed mid-generation ends generate() with the rank named;
* the cluster is shut down in teardown, whatever happened.

Each node has 2 logical CPUs and a resource of its own name (``node_a`` / ``node_b`` / ``node_c``),
so the test can tell where each actor ran.
"""

from __future__ import annotations

import pytest

from core import LLM
from tests.helpers import tiny_llama_dir
from tests.integration.test_pipeline_parallel import (
    KILL_DEADLINE_S,
    LAYERS,
    ROOMY,
    TIGHT,
    InFlight,
    greedy,
    seconds_until_worker_error,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402 - only with Ray installed

VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = str(tiny_llama_dir(tmp_path_factory.mktemp("ray-mn"), seed=5, num_hidden_layers=LAYERS))
    llm = LLM(model=path, **ROOMY)
    try:
        return path, greedy(llm, VOCAB)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                       "include_dashboard": False})
    try:
        c.add_node(num_cpus=2, resources={"node_b": 1})
        c.add_node(num_cpus=2, resources={"node_c": 1})
        c.wait_for_nodes()
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def node_names(cluster) -> dict[str, str]:
    """Ray node id -> the fake resource naming that node."""
    ray.init(address=cluster.address)
    try:
        return {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node_"))
                for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()


@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 3), (2, 2)], ids=["pp2", "pp3", "tp2xpp2"])
def test_stages_spread_over_nodes_and_match(model, cluster, tp, pp):
    path, reference = model
    names = node_names(cluster)
    llm = LLM(model=path, executor="ray", ray_address=cluster.address,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, **TIGHT)
    try:
        flight = InFlight(llm.engine.executor)
        assert greedy(llm, VOCAB) == reference
        assert llm.engine.scheduler.stats().num_preemptions > 0
        assert flight.most == pp
        where = [names[n] for n in llm.engine.executor.nodes]
        stages = [set(where[s * tp:(s + 1) * tp]) for s in range(pp)]
        assert all(len(s) == 1 for s in stages), f"a TP group crossed nodes: {where}"
        assert len(set.union(*stages)) == pp, f"stages share a node: {where}"
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()  # the engine disconnected from the cluster it joined


def test_tp_group_larger_than_a_node_is_refused(model, cluster):
    path, _ = model
    with pytest.raises(ValueError, match=r"keeps each stage's 4 ranks on one node, but no node of the Ray cluster has 4 CPU \(the most on one node is 2\)"):
        LLM(model=path, executor="ray", ray_address=cluster.address, tensor_parallel_size=4, **ROOMY)
    assert not ray.is_initialized()


def test_killed_stage_on_another_node_ends_generate(model, cluster):
    """PP=2 over two nodes: SIGKILL the last stage's actor mid-generation; generate() raises
    the executor's WorkerError naming the rank (the figure is printed; the bound is generous
    because the machine may be busy)."""
    path, _ = model
    llm = LLM(model=path, executor="ray", ray_address=cluster.address,
              pipeline_parallel_size=2, **dict(ROOMY, max_model_len=256))
    try:
        victim = len(llm.engine.executor.worker_pids) - 1
        elapsed = seconds_until_worker_error(llm, llm.engine.executor.worker_pids[victim],
                                             rf"worker rank {victim} \(a Ray actor\) died")
    finally:
        llm.engine.shutdown()
    print(f"Ray stage {victim} killed: generate() raised after {elapsed:.2f} s")
    assert elapsed < KILL_DEADLINE_S
    assert not ray.is_initialized()
