"""Tensor parallelism end to end on CPU with gloo: two ranks must give the same greedy
tokens as one, through worker processes and through Ray actors; a rank killed in the
middle of a generation must end it with the documented error, leaving no process behind;
sizes that cannot work are refused at start with the numbers.

The reference is the in-process engine (TP=1), itself checked against HF transformers in
test_engine_hf.py. The models are chosen to exercise the sharding: the Llama ties its
embeddings (the sharded embedding is the LM head) and splits its 2 KV heads over 2 ranks;
the Qwen2 has biases on q/k/v, a single KV head (replicated on both ranks) and a
vocabulary of 509 that does not divide by 2 (the last rank's rows are padding).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
import time

import pytest

from core import LLM, SamplingParams
from core.config import ParallelConfig
from core.engine import resolve_config
from core.engine_args import EngineArgs
from core.executor.multiproc import worker_visibility
from core.executor.parallel_check import validate_parallel
from core.executor.worker import WorkerError
from platforms.cpu.platform import CpuPlatform
from tests.helpers import tiny_llama_dir, tiny_model_dir

MAX_NEW = 10
KILL_DEADLINE_S = 30.0
# A 32-token step budget splits the 40-token prompt over two steps, so ranks also run
# steps that sample nothing.
ENGINE = dict(
    platform="cpu", dtype="float32", block_size=16, kv_cache_memory="2MiB",
    max_model_len=256, max_num_batched_tokens=32,
)


def prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 40, 9)]


def generate(llm: LLM, vocab: int) -> list[tuple[list[int], list[dict]]]:
    """Greedy ids and per-token top-2 logprobs; the last prompt also asks for prompt
    logprobs (a path where every rank computes logits but only rank 0 answers)."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    params = [sp] * 3 + [dataclasses.replace(sp, prompt_logprobs=1)]
    outs = llm.generate(prompts(vocab), params, use_tqdm=False)
    assert outs[3].prompt_logprobs is not None and len(outs[3].prompt_logprobs) == 9
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        for step_got, step_want in zip(lp_got, lp_want):
            assert step_got.keys() == step_want.keys()
            for tok in step_want:
                assert step_got[tok].logprob == pytest.approx(step_want[tok].logprob, abs=1e-4)


@dataclasses.dataclass
class Model:
    path: str
    vocab: int
    reference: list  # generate() of the TP=1 in-process engine


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("tp")
    dirs = {
        "llama": (tiny_llama_dir(root, seed=1, tie_word_embeddings=True), 512),
        "qwen2": (tiny_model_dir(root, "qwen2", seed=2, num_key_value_heads=1, vocab_size=509), 509),
    }
    found = {}
    for family, (path, vocab) in dirs.items():
        llm = LLM(model=str(path), **ENGINE)
        found[family] = Model(str(path), vocab, generate(llm, vocab))
        llm.engine.shutdown()
    return found


def engine_pool(models, executor: str, one_at_a_time: bool = False):
    """A factory of TP=2 engines, one per model family, built on first use; with
    ``one_at_a_time`` building one shuts the others down first."""
    engines: dict[str, LLM] = {}

    def get(family: str) -> LLM:
        if family not in engines:
            if one_at_a_time:
                for other in engines.values():
                    other.engine.shutdown()
            engines[family] = LLM(
                model=models[family].path, tensor_parallel_size=2, executor=executor, **ENGINE
            )
        return engines[family]

    return engines, get


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kill_mid_generation(llm: LLM, kill) -> float:
    """Run a long generation, call ``kill()`` once it is under way, and return the
    seconds from the kill until generate() raised the documented error."""
    marks: dict[str, float | bool] = {}

    def killer() -> None:
        deadline = time.monotonic() + 60
        while not llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        marks["busy"] = llm.engine.has_unfinished_requests()
        marks["t"] = time.monotonic()
        kill()

    sp = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    thread = threading.Thread(target=killer)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 .*died") as info:
            llm.generate([[5, 6, 7, 8]] * 8, sp, use_tqdm=False)
    finally:
        thread.join()
    assert isinstance(info.value, WorkerError)
    assert marks["busy"], "the kill must land while requests are running"
    return time.monotonic() - marks["t"]


# ---- validation at start (no worker is started) ---------------------------------------------------


class FakeGpuPlatform(CpuPlatform):
    """A device platform with two devices, for the device-count check."""

    name = "fakegpu"
    device_type = "fakegpu"
    device_visibility_env = "FAKEGPU_VISIBLE_DEVICES"

    def device_count(self) -> int:
        return 2


@pytest.fixture(scope="module")
def base_config(models):
    return resolve_config(EngineArgs(model=models["llama"].path, **ENGINE), CpuPlatform())


def with_sizes(config, tp: int, executor: str = "auto", **hf):
    from transformers import LlamaConfig

    fields = {**config.model.hf_config.to_dict(), **hf}
    model = dataclasses.replace(config.model, hf_config=LlamaConfig(**fields))
    return dataclasses.replace(config, model=model, parallel=ParallelConfig(tp, executor))


@pytest.mark.parametrize(
    "tp, hf, executor, message",
    [
        (3, {}, "mp", r"--tensor-parallel-size 3 does not divide the model's 4 attention heads; use a size that divides 4: \[1, 2, 4\]"),
        (3, dict(num_attention_heads=6, num_key_value_heads=4, hidden_size=96), "mp", r"--tensor-parallel-size 3 and the model's 4 KV heads fit neither way.*one of \[1, 2\]"),
        (2, dict(intermediate_size=129), "mp", r"does not divide the model's intermediate size 129"),
        (2, {}, "uni", r"--executor uni .* cannot run --tensor-parallel-size 2 x --pipeline-parallel-size 1; use --executor mp"),
        (0, {}, "mp", r"--tensor-parallel-size must be at least 1, got 0"),
        (2, {}, "spark", r"unknown executor 'spark'"),
    ],
)
def test_bad_sizes_are_refused(base_config, tp, hf, executor, message):
    with pytest.raises(ValueError, match=message):
        validate_parallel(with_sizes(base_config, tp, executor, **hf), CpuPlatform())


def test_sizes_that_fit(base_config):
    cpu = CpuPlatform()
    validate_parallel(with_sizes(base_config, 4, num_key_value_heads=2), cpu)  # KV replicated
    validate_parallel(with_sizes(base_config, 4, num_key_value_heads=4), cpu)  # KV split
    validate_parallel(with_sizes(base_config, 2, vocab_size=509), cpu)  # vocabulary is padded


def test_device_count_is_checked_for_one_host_executors(base_config):
    fake = FakeGpuPlatform()
    validate_parallel(with_sizes(base_config, 2, "mp"), fake)
    with pytest.raises(ValueError, match=r"needs 4 fakegpu devices but this host has 2 visible \(check FAKEGPU_VISIBLE_DEVICES\); lower the sizes to at most 2 devices in all"):
        validate_parallel(with_sizes(base_config, 4, "mp"), fake)
    # A Ray cluster may hold more devices than this host: checked when placing the group.
    validate_parallel(with_sizes(base_config, 4, "ray"), fake)


def test_more_cpu_ranks_than_cores_warn(base_config, caplog):
    tp = 2 * (os.cpu_count() or 1)
    with caplog.at_level(logging.WARNING, logger="core.executor.parallel_check"):
        validate_parallel(with_sizes(base_config, tp, num_attention_heads=tp, num_key_value_heads=tp, intermediate_size=128 * tp), CpuPlatform())
    assert f"starts {tp} worker processes on {os.cpu_count()} CPU cores" in caplog.text


def test_engine_refuses_before_starting_workers(models):
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(model=models["llama"].path, tensor_parallel_size=3, **ENGINE)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "given, expected",
    [(None, ["0", "1"]), ("4,5", ["4", "5"]), ("GPU-aa, GPU-bb,GPU-cc", ["GPU-aa", "GPU-bb"])],
)
def test_each_worker_sees_its_own_device(monkeypatch, given, expected):
    if given is None:
        monkeypatch.delenv("FAKEGPU_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("FAKEGPU_VISIBLE_DEVICES", given)
    fake = FakeGpuPlatform()
    assert [worker_visibility(fake, r, 2) for r in range(2)] == [
        ("FAKEGPU_VISIBLE_DEVICES", e) for e in expected
    ]
    assert worker_visibility(CpuPlatform(), 1, 2) is None


def test_too_few_visible_devices_are_refused(monkeypatch):
    monkeypatch.setenv("FAKEGPU_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"FAKEGPU_VISIBLE_DEVICES='3' lists 1 device\(s\) but the engine needs 2 \(--tensor-parallel-size x --pipeline-parallel-size\)"):
        worker_visibility(FakeGpuPlatform(), 1, 2)


# ---- multiprocess executor -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mp_engines(models):
    engines, get = engine_pool(models, "mp")
    yield get
    for llm in engines.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_multiproc_tp2_matches_tp1(models, mp_engines, family):
    llm = mp_engines(family)
    assert_same(generate(llm, models[family].vocab), models[family].reference)
    llm.engine.executor.check_health()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_multiproc_shutdown_stops_every_worker(mp_engines):
    llm = mp_engines("qwen2")
    pids = llm.engine.executor.worker_pids
    assert all(alive(p) for p in pids)
    llm.engine.shutdown()
    assert wait_gone(pids, within=10) == []
    llm.engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.engine.executor.check_health()


def test_multiproc_killed_rank_ends_generate(mp_engines):
    llm = mp_engines("llama")
    pids = llm.engine.executor.worker_pids
    elapsed = kill_mid_generation(llm, lambda: os.kill(pids[1], signal.SIGKILL))
    assert elapsed < KILL_DEADLINE_S
    assert wait_gone(pids, within=10) == []  # rank 0 was stopped too
    with pytest.raises(RuntimeError, match=r"failed earlier: .*rank 1 \(pid \d+\) died: killed by signal SIGKILL"):
        llm.engine.executor.check_health()
    with pytest.raises(RuntimeError, match="failed earlier"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_worker_error_reaches_the_caller(models):
    # 8 KiB holds 2 blocks of 4 KiB per rank; max_model_len 256 needs 17: every rank refuses.
    args = {**ENGINE, "kv_cache_memory": "8KiB"}
    with pytest.raises(ValueError, match=r"max_model_len 256 needs 16 blocks") as info:
        LLM(model=models["llama"].path, tensor_parallel_size=2, **args)
    assert "raised on parallel rank" in "\n".join(getattr(info.value, "__notes__", []))


# ---- Ray executor (one local cluster of 2 CPUs for the module) ------------------------------------
# The cluster holds one TP=2 engine at a time, so the pool keeps one engine and these
# tests run in file order: llama (matches, then its rank is killed), then qwen2.


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_engines(models, ray_cluster):
    engines, get = engine_pool(models, "ray", one_at_a_time=True)
    yield get
    for llm in engines.values():
        llm.engine.shutdown()


def test_ray_tp2_matches_tp1_llama(models, ray_engines):
    llm = ray_engines("llama")
    assert_same(generate(llm, models["llama"].vocab), models["llama"].reference)
    llm.engine.executor.check_health()


def test_ray_killed_actor_ends_generate(ray_engines):
    llm = ray_engines("llama")
    pids = llm.engine.executor.worker_pids
    elapsed = kill_mid_generation(llm, lambda: os.kill(pids[1], signal.SIGKILL))
    assert elapsed < KILL_DEADLINE_S
    assert wait_gone(pids, within=15) == []  # rank 0's actor was killed too
    with pytest.raises(RuntimeError, match=r"failed earlier: .*rank 1 \(a Ray actor\) died"):
        llm.engine.executor.check_health()


def test_ray_tp2_matches_tp1_qwen2(models, ray_engines):
    llm = ray_engines("qwen2")
    assert_same(generate(llm, models["qwen2"].vocab), models["qwen2"].reference)
    llm.engine.executor.check_health()


def test_ray_shutdown_kills_actors_and_frees_the_cluster(ray_cluster, ray_engines):
    llm = ray_engines("qwen2")
    pids = llm.engine.executor.worker_pids
    llm.engine.shutdown()
    assert wait_gone(pids, within=15) == []
    with pytest.raises(RuntimeError, match="has been shut down"):
        llm.engine.executor.check_health()
    # The placement group is gone: both CPUs are free again for the next engine.
    deadline = time.monotonic() + 15
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.available_resources().get("CPU", 0) == 2


def test_ray_refuses_a_group_larger_than_the_cluster(models, ray_cluster):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 x --pipeline-parallel-size 1 needs 4 x CPU in the Ray cluster, which has 2"):
        LLM(model=models["llama"].path, tensor_parallel_size=4, executor="ray", **ENGINE)


# ---- NCCL on two GPUs (runs only where two NVIDIA GPUs are visible) ------------------------------


@pytest.mark.cuda
def test_cuda_nccl_tp2_matches_tp1(tmp_path):
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two NVIDIA GPUs")
    # head size 64: one the CUDA kernels support
    path = str(tiny_llama_dir(tmp_path, seed=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2))
    cuda = {**ENGINE, "platform": "cuda"}
    tp2 = LLM(model=path, tensor_parallel_size=2, **cuda)
    try:
        got = generate(tp2, 512)
    finally:
        tp2.engine.shutdown()
    tp1 = LLM(model=path, **cuda)
    assert_same(got, generate(tp1, 512))
