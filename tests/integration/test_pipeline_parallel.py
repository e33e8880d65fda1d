"""Pipeline parallelism end to end on CPU with gloo, and the one start-up path.

PP=2, PP=3 and TP=2 x PP=2 (worker processes, ``--executor mp``) must give the greedy
tokens of the in-process TP=1 engine (itself checked against HF transformers in
test_engine_hf.py) through batching (four prompts at once), chunked prefill (a 32-token
step budget splits the 40-token prompt) and preemption (six KV blocks, where the four
requests need nine), with several micro-batches in flight. A stage process killed in the
middle of a generation ends it with the documented error, and a server's ``/health``
answers 503. Without a model, the scheduler driven with 2-4 steps in flight (the fake
engine of test_scheduler.py, which checks every KV read) never schedules a sequence whose
token is in flight and gives the reference outputs through chunking, forks, stops and both
preemption modes. Sizes that cannot work are refused at start with the numbers. The
multiprocess executor runs the same memory profile and plans the same KV cache as the
in-process one.

On GPUs (``cuda`` marker; skipped elsewhere), on the machine with 2 (PP=2) or 4 (TP=2 x
PP=2) H200s: ``PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider -m cuda
tests/integration/test_pipeline_parallel.py`` (NCCL sends between stages, each rank's memory
profile on its own GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import signal
import threading
import time
from collections import deque

import httpx2
import pytest

from core import LLM, SamplingParams
from core.config import ParallelConfig
from core.engine import resolve_config
from core.engine_args import EngineArgs
from core.executor.multiproc import MultiprocExecutor
from core.executor.parallel_check import validate_parallel
from core.executor.pipeline import check_pipeline_support, split_layers, stage_layers
from core.executor.startup import StartupReport, agree_plans
from core.executor.uni import UniExecutor
from core.executor.worker import WorkerError
from core.kv_plan import plan_kv_cache
from core.model_runner import RunnerSetup
from core.models import ModelRegistry
from core.ops import Ops
from core.scheduler import Scheduler
from platforms.cpu.platform import CpuPlatform
from tests.helpers import tiny_llama_dir, tiny_model_dir
from tests.integration import live_server
from tests.integration.test_tensor_parallel import FakeGpuPlatform
from tests.unit.test_scheduler import FakeEngine

MAX_NEW = 10
LAYERS = 4
# 64 tokens per sequence at most: 4 blocks of 16 (+ the null block). Six blocks hold one
# or two of the four requests at a time, so the scheduler must preempt.
ENGINE = dict(platform="cpu", dtype="float32", block_size=16, max_model_len=64,
              max_num_batched_tokens=32)
TIGHT = dict(ENGINE, num_blocks_override=6)
ROOMY = dict(ENGINE, kv_cache_memory="2MiB")
KILL_DEADLINE_S = 30.0


def prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 40, 9)]


def greedy(llm: LLM, vocab: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(vocab), sp, use_tqdm=False)]


@dataclasses.dataclass
class Model:
    path: str
    vocab: int
    reference: list[list[int]]  # greedy() of the in-process TP=1 engine, ample KV cache


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("pp")
    dirs = {
        # tied embeddings: the last stage keeps the embedding for its LM head
        "llama": (tiny_llama_dir(root, seed=1, tie_word_embeddings=True, num_hidden_layers=LAYERS), 512),
        # q/k/v biases, one KV head (replicated under TP), an odd vocabulary
        "qwen2": (tiny_model_dir(root, "qwen2", seed=2, num_key_value_heads=1, vocab_size=509,
                                 num_hidden_layers=LAYERS), 509),
    }
    found = {}
    for family, (path, vocab) in dirs.items():
        llm = LLM(model=str(path), **ROOMY)
        found[family] = Model(str(path), vocab, greedy(llm, vocab))
        llm.engine.shutdown()
    return found


class InFlight:
    """Counts the engine's launched, not yet read steps (wraps the executor's launch)."""

    def __init__(self, executor):
        self.now = self.most = 0
        launch = executor.launch

        def counted(sched):
            handle = launch(sched)
            self.now += 1
            self.most = max(self.most, self.now)
            result = handle.result

            def read():
                if not getattr(handle, "_counted", False):
                    handle._counted = True
                    self.now -= 1
                return result()

            handle.result = read
            return handle

        executor.launch = counted


@pytest.mark.parametrize(
    "family, tp, pp, split",
    [("llama", 1, 2, None), ("qwen2", 1, 3, None), ("llama", 2, 2, None), ("llama", 1, 2, "3,1")],
    ids=["pp2", "pp3-qwen2", "tp2xpp2", "pp2-split-3-1"],
)
def test_pipeline_matches_single_process(models, family, tp, pp, split):
    m = models[family]
    llm = LLM(model=m.path, tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_layer_split=split, **TIGHT)
    try:
        flight = InFlight(llm.engine.executor)
        assert greedy(llm, m.vocab) == m.reference
        assert llm.engine.scheduler.stats().num_preemptions > 0, "the tiny cache must force preemption"
        assert flight.most == pp, f"{pp} micro-batches should be in flight at once"
        reports = llm.engine.executor.startup_reports
        assert [r.rank for r in reports] == list(range(tp * pp))
        assert len({r.plan.num_blocks for r in reports}) == 1
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks
        llm.engine.executor.check_health()
    finally:
        llm.engine.shutdown()


def test_each_stage_holds_only_its_layers(models, caplog):
    """Weights and KV cache per stage: a 3,1 split gives stage 0 three layers' KV bytes
    per block and stage 1 one layer's (the block count is the same on both); the driver
    logs every rank's plan."""
    with caplog.at_level(logging.INFO, logger="core.executor.startup"):
        llm = LLM(model=models["llama"].path, pipeline_parallel_size=2, pp_layer_split="3,1", **ROOMY)
    try:
        for rank in (0, 1):
            assert re.search(rf"rank {rank}: weights [0-9.]+ MiB, profiled peak not measured; KV cache: \d+ blocks", caplog.text)
        first, last = llm.engine.executor.startup_reports
        assert first.plan.bytes_per_block == 3 * last.plan.bytes_per_block
        assert first.plan.num_blocks == last.plan.num_blocks
        # stage 0: embedding + 3 layers; stage 1: 1 layer + norm + the tied embedding as LM head
        assert first.weights_bytes > last.weights_bytes
    finally:
        llm.engine.shutdown()


# ---- the scheduler with several micro-batches in flight (no model) --------------------------------


class PipelineFake(FakeEngine):
    """tests/unit/test_scheduler.py's fake engine (a simulated KV cache that checks every
    sequence reads its exact history) driven like the engine core's pipelined loop: up to
    ``depth`` steps scheduled before the oldest one's tokens reach ``update``. The fake
    device runs each step when it is scheduled, in order, as every pipeline stage does."""

    def __init__(self, depth: int, num_blocks: int, **cfg):
        super().__init__(num_blocks, **cfg)
        self.sched = Scheduler(self.cfg, self.bm, max_in_flight=depth)
        self.depth, self.queue, self.most = depth, deque(), 0

    def step(self):
        launched = False
        if len(self.queue) < self.depth and self.sched.has_unfinished_requests():
            out = self.sched.schedule()
            self.history.append(out)
            self.aborted.update(out.aborted)
            self._check(out)  # with pipelined=False: nothing scheduled has a token in flight
            in_flight = {e.seq_id for o, _ in self.queue for e in o.scheduled if e.sample}
            assert not in_flight & {e.seq_id for e in out.scheduled}
            result = self._execute(out)
            if out.scheduled or out.blocks_to_copy or out.blocks_to_swap_in or out.blocks_to_swap_out:
                self.queue.append((out, result))
                launched = True
            else:
                self.deltas += self.sched.update(out, result)
        self.most = max(self.most, len(self.queue))
        if self.queue and (not launched or len(self.queue) >= self.depth):
            self.deltas += self.sched.update(*self.queue.popleft())
        self.bm.check_invariants()

    def run(self, max_steps: int = 5000) -> None:
        steps = 0
        while self.sched.has_unfinished_requests() or self.queue:
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler does not make progress"


@pytest.mark.parametrize("depth", [2, 3, 4])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(4))
def test_scheduler_keeps_micro_batches_apart(depth, mode, seed):
    rng = random.Random(seed)
    eng = PipelineFake(depth, num_blocks=14, num_host_blocks=16 if mode == "swap" else 0,
                       max_num_batched_tokens=12, preemption_mode=mode, max_model_len=64)
    for i in range(10):
        eng.add(f"r{i}", [rng.randrange(1, 97) for _ in range(rng.randrange(1, 30))],
                max_tokens=rng.randrange(1, 12), n=rng.choice([1, 1, 2]), stops=rng.random() < 0.3)
    eng.run()
    for rid in eng.requests:
        assert eng.outputs(rid) == eng.expected(rid), rid
    assert eng.most == depth
    assert eng.sched.stats().num_preemptions > 0
    eng.assert_all_free()


# ---- sizes refused at start ------------------------------------------------------------------------


def test_even_split_and_overrides():
    assert split_layers(30, 4) == [8, 8, 7, 7]
    assert split_layers(4, 3) == [2, 1, 1]
    assert split_layers(30, 4, [10, 10, 5, 5]) == [10, 10, 5, 5]
    assert [(s.start, s.end) for s in (stage_layers(30, 4, i) for i in range(4))] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 5 would leave 1 stage\(s\) without a layer: the model has 4 layers; use at most 4 stages"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match=r"--pp-layer-split 3,0 does not fit.*2 counts >= 1.*4 layers; it has 2 adding up to 3\. The even split is 2,2"):
        split_layers(4, 2, [3, 0])


@pytest.fixture(scope="module")
def base_config(models):
    return resolve_config(EngineArgs(model=models["llama"].path, **ROOMY), CpuPlatform())


def sized(config, tp: int, pp: int, executor: str = "auto", split=None):
    return dataclasses.replace(config, parallel=ParallelConfig(tp, executor, pp, split))


def test_world_larger_than_the_devices_is_refused(base_config):
    fake = FakeGpuPlatform()
    validate_parallel(sized(base_config, 1, 2, "mp"), fake)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 x --pipeline-parallel-size 2 needs 4 fakegpu devices but this host has 2 visible \(check FAKEGPU_VISIBLE_DEVICES\)"):
        validate_parallel(sized(base_config, 2, 2, "mp"), fake)
    validate_parallel(sized(base_config, 2, 2, "ray"), fake)  # checked against the cluster


@pytest.mark.parametrize(
    "tp, pp, split, executor, message",
    [
        (1, 5, None, "mp", r"--pipeline-parallel-size 5 would leave 1 stage\(s\) without a layer"),
        (3, 2, None, "mp", r"--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
        (1, 2, (1, 1), "mp", r"--pp-layer-split 1,1 does not fit"),
        (1, 1, (2, 2), "mp", r"--pp-layer-split needs --pipeline-parallel-size 2 or more"),
        (1, 2, None, "uni", r"--executor uni .* cannot run --tensor-parallel-size 1 x --pipeline-parallel-size 2"),
        (1, 0, None, "mp", r"--pipeline-parallel-size must be at least 1, got 0"),
    ],
)
def test_bad_pipeline_sizes_are_refused(base_config, tp, pp, split, executor, message):
    with pytest.raises(ValueError, match=message):
        validate_parallel(sized(base_config, tp, pp, executor, split), CpuPlatform())


def test_engine_refuses_before_starting_workers(models):
    with pytest.raises(ValueError, match="without a layer"):
        LLM(model=models["llama"].path, pipeline_parallel_size=LAYERS + 1, **ROOMY)
    with pytest.raises(ValueError, match=r"pp_layer_split \(--pp-layer-split\)='2,x' is invalid"):
        LLM(model=models["llama"].path, pipeline_parallel_size=2, pp_layer_split="2,x", **ROOMY)


def test_models_without_stages_are_refused():
    registry = ModelRegistry()
    check_pipeline_support(registry.resolve("LlamaForCausalLM"), "LlamaForCausalLM", 2)
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 2: the GPT2LMHeadModel model .* cannot be split into stages"):
        check_pipeline_support(registry.resolve("GPT2LMHeadModel"), "GPT2LMHeadModel", 2)


# ---- one start-up path ----------------------------------------------------------------------------


class ProfilingCpuPlatform(CpuPlatform):
    """A CPU platform that reports a memory profile (as a device platform does) and a
    fixed KV budget, so the plan shows whether the profile ran. Module level: the worker
    processes unpickle it."""

    PEAK = 7 << 20
    TOTAL = 16 << 20

    def reset_peak_memory(self) -> None:
        self._profiling = True

    def peak_memory_bytes(self) -> int | None:
        return self.PEAK if getattr(self, "_profiling", False) else None

    def kv_cache_budget(self, requested_bytes, memory_utilization, weights_bytes) -> int:
        return self.TOTAL - weights_bytes


def _setup(models, **parallel) -> RunnerSetup:
    platform = ProfilingCpuPlatform()
    config = resolve_config(EngineArgs(model=models["llama"].path, **ENGINE, **parallel), platform)
    return RunnerSetup(config, platform, Ops(platform.ops()), ModelRegistry())


def test_multiprocess_runs_the_single_process_memory_profile(models):
    uni = UniExecutor(_setup(models), frozenset())
    want = uni.initialize()
    (single,) = uni.startup_reports
    assert single.peak_bytes == ProfilingCpuPlatform.PEAK
    assert want.num_blocks == (ProfilingCpuPlatform.TOTAL - ProfilingCpuPlatform.PEAK) // want.bytes_per_block
    for parallel in (dict(executor="mp"), dict(pipeline_parallel_size=2)):
        mp = MultiprocExecutor(_setup(models, **parallel), frozenset())
        try:
            got = mp.initialize()
            reports = mp.startup_reports
        finally:
            mp.shutdown()
        assert [r.peak_bytes for r in reports] == [ProfilingCpuPlatform.PEAK] * len(reports)
        if len(reports) == 1:  # the same rank as the in-process one: the same plan
            assert reports[0].weights_bytes == single.weights_bytes
            assert got == want
        else:  # each stage holds half the layers: twice the blocks fit the same budget
            assert got.num_blocks == min(
                (ProfilingCpuPlatform.TOTAL - ProfilingCpuPlatform.PEAK) // r.plan.bytes_per_block
                for r in reports
            )
            assert got.num_blocks > want.num_blocks


def test_plans_that_differ_are_refused():
    plan = plan_kv_cache(budget_bytes=1 << 20, bytes_per_block=4096, block_size=16, max_model_len=64)
    other = dataclasses.replace(plan, num_blocks=plan.num_blocks - 1)
    same_blocks = dataclasses.replace(plan, bytes_per_block=2048)  # another stage's layers
    assert agree_plans([StartupReport(0, 1, None, plan), StartupReport(1, 1, None, same_blocks)]) == plan
    with pytest.raises(RuntimeError, match=r"the ranks' KV plans differ: rank 0 has \(256, 0, 16, 64, None\), rank 1 \(255, 0, 16, 64, None\)"):
        agree_plans([StartupReport(0, 1, None, plan), StartupReport(1, 1, None, other)])


# ---- a stage process dies ---------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def seconds_until_worker_error(llm: LLM, pid: int, match: str) -> float:
    """SIGKILL ``pid`` once a long generation is under way; check that generate() raises the
    WorkerError ``match`` describes and return the seconds from the kill until it did."""
    marks: dict[str, float] = {}

    def killer() -> None:
        deadline = time.monotonic() + 60
        while not llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        marks["t"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        with pytest.raises(WorkerError, match=match):
            llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(temperature=0, max_tokens=240, ignore_eos=True), use_tqdm=False)
    finally:
        thread.join()
    return time.monotonic() - marks["t"]


@pytest.mark.parametrize("victim", [0, 1], ids=["first-stage", "last-stage"])
def test_killed_stage_ends_generate(models, victim):
    llm = LLM(model=models["llama"].path, pipeline_parallel_size=2, **dict(ROOMY, max_model_len=256))
    pids = llm.engine.executor.worker_pids
    try:
        elapsed = seconds_until_worker_error(
            llm, pids[victim], rf"worker rank {victim} \(pid \d+\) died: killed by signal SIGKILL")
    finally:
        llm.engine.shutdown()
    print(f"stage {victim} killed: generate() raised after {elapsed:.2f} s")
    assert elapsed < KILL_DEADLINE_S
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_killed_stage_makes_health_503(models, tmp_path):
    """``core serve -pp 2``: kill the last stage's process while a completion runs; the
    request fails and /health turns 503 naming the dead rank (bounded waits)."""
    server = live_server.start(models["llama"].path, tmp_path / "serve.log", "-pp", "2")
    try:
        live_server.wait_ready(server)
        found = re.search(r"2 worker processes, pids by rank: \[(\d+), (\d+)\]", server.log_text())
        assert found, server.log_tail()
        victim = int(found.group(2))
        body = {"model": live_server.MODEL, "prompt": [5, 6, 7], "max_tokens": 240,
                "ignore_eos": True, "stream": True}
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        request = threading.Thread(target=stream)
        request.start()
        assert started.wait(120), server.log_tail()
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 60
        health = httpx2.get(server.url + "/health", timeout=10)
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
            health = httpx2.get(server.url + "/health", timeout=10)
        took = time.monotonic() - killed
        request.join(timeout=120)
        print(f"last stage killed: /health 503 after {took:.2f} s")
        assert health.status_code == 503, server.log_tail()
        assert re.search(rf"worker rank 1 \(pid {victim}\) died: killed by signal SIGKILL",
                         health.json()["error"]["message"]), health.json()
        assert not request.is_alive()
        # the stream was cut short with an error event naming the dead rank
        assert "[DONE]" not in lines[-1] and any("worker rank 1" in line for line in lines), lines[-3:]
        assert server.proc.poll() is None  # the API server stays up to answer 503s
    finally:
        live_server.stop(server)


# ---- NCCL on GPUs (runs only where enough NVIDIA GPUs are visible) --------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_cuda_nccl_pipeline_matches_one_gpu(tmp_path, tp, pp):
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} NVIDIA GPUs")
    # head size 64: one the CUDA kernels support; no --kv-cache-memory: every rank profiles
    path = str(tiny_llama_dir(tmp_path, seed=4, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=LAYERS))
    cuda = dict(ENGINE, platform="cuda", gpu_memory_utilization=0.3, enforce_eager=True)
    llm = LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **cuda)
    try:
        got = greedy(llm, 512)
        reports = llm.engine.executor.startup_reports
    finally:
        llm.engine.shutdown()
    assert all(r.peak_bytes is not None for r in reports), "every rank runs the memory profile"
    one = LLM(model=path, **cuda)
    try:
        assert got == greedy(one, 512)
    finally:
        one.engine.shutdown()
