"""AsyncLLMEngine over a real engine-core process (tiny random Llama): the core runs in
another process, every output is delivered and matches the in-process engine, aborts cross
the IPC and free the KV cache, refusals reach the caller, and a dead engine core (a failing
step, SIGKILL, a start-up error) fails every waiter fast with a clear error."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from core.async_engine import AsyncLLMEngine, EngineDeadError, EngineStartupError
from core.engine import EngineOverloaded, LLMEngine
from core.engine_args import EngineArgs
from core.engine_core.core import EngineCore
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir

ARGS = dict(max_model_len=128, dtype="float32", platform="cpu", kv_cache_memory="8MiB")
WAIT_S = 60.0
"""Bound on every wait for the engine (generous: a loaded 2-core CI box)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_llama_dir(tmp_path_factory.mktemp("async")))


@pytest.fixture(scope="module")
def finished():
    """Finished outputs seen by the on_finished hook (shared by the module's engine)."""
    return []


@pytest.fixture(scope="module")
def engine(model_dir, finished):
    eng = AsyncLLMEngine(EngineArgs(model=model_dir, **ARGS), on_finished=finished.append)
    yield eng
    eng.shutdown(10)


@pytest.fixture
def fresh(finished):
    """The finished list, emptied for this test."""
    finished.clear()
    return finished


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def _collect(engine: AsyncLLMEngine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _wait_idle(engine: AsyncLLMEngine, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.snapshot.scheduler
        if s is not None and (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0) \
                and engine.num_open_streams() == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def _assert_aborted_early(finished, n_max: int) -> None:
    assert len(finished) == 1
    comp = finished[0].outputs[0]
    assert comp.finish_reason == "abort" and len(comp.token_ids) < n_max


def test_the_engine_core_runs_in_its_own_process(engine):
    assert engine.proc.is_alive() and engine.info.pid == engine.proc.pid != os.getpid()
    engine.check_health()


def test_streams_are_complete_and_match_the_in_process_engine(engine, model_dir):
    prompts = [f"prompt number {i}" for i in range(12)]

    async def run():
        return await asyncio.gather(*(_collect(engine, p, _greedy(10)) for p in prompts))

    streams = asyncio.run(run())
    sync = LLMEngine.from_args(EngineArgs(model=model_dir, **ARGS))
    ids = [sync.add_request(None, p, _greedy(10)) for p in prompts]
    done = {}
    while sync.has_unfinished_requests():
        done.update({o.request_id: o for o in sync.step() if o.finished})
    for outs, rid in zip(streams, ids):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 10  # cumulative, nothing lost
        assert outs[-1].outputs[0].token_ids == done[rid].outputs[0].token_ids
        assert outs[-1].outputs[0].text == done[rid].outputs[0].text
    assert engine.num_open_streams() == 0
    assert engine.snapshot.generation_tokens >= 12 * 10


def test_the_engine_cores_time_stamps_order_with_the_front_ends(engine):
    """The engine core stamps its receipt of a request and the step that first ran it with
    its own clock (another process); they must fall between the front end's arrival and
    first token, in order, on every request of a concurrent burst."""
    async def run():
        return await asyncio.gather(*(_collect(engine, f"stamp {i}", _greedy(4)) for i in range(8)))

    for outs in asyncio.run(run()):
        m = outs[-1].metrics
        assert None not in (m.engine_received_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
        assert m.arrival_time <= m.engine_received_time <= m.first_scheduled_time <= m.first_token_time \
            <= m.finished_time, m


def test_arrival_is_stamped_before_tokenization(engine, monkeypatch):
    """A request arrives when add_request is called: its tokenization (here made to last at
    least 50 ms) counts towards TTFT and the front-end time, not before the arrival."""
    tokenize = engine._inputs._tokenize

    def slow(prompt):
        time.sleep(0.05)
        return tokenize(prompt)

    monkeypatch.setattr(engine._inputs, "_tokenize", slow)
    m = asyncio.run(_collect(engine, "slow to tokenize", _greedy(2)))[-1].metrics
    assert m.engine_received_time - m.arrival_time >= 0.05, m
    assert m.first_token_time - m.arrival_time >= 0.05, m


def test_consumer_leaving_early_aborts_and_frees_blocks(engine, fresh):
    async def run():
        gen = engine.generate("leave early", _greedy(100))
        first = await gen.__anext__()
        await gen.aclose()
        return first, await _wait_idle(engine)

    first, idle = asyncio.run(run())
    assert not first.finished
    assert idle, f"engine not idle: {engine.snapshot}"
    _assert_aborted_early(fresh, 100)


def test_cancelled_consumer_aborts(engine, fresh):
    async def run():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancel me", _greedy(100)):
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()  # cancel mid-stream, not at a time that may be after the end
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _wait_idle(engine)

    assert asyncio.run(run())
    _assert_aborted_early(fresh, 100)


def test_abort_storm_leaves_every_kv_block_free(engine, fresh):
    rng = random.Random(0)

    async def one(i: int) -> None:
        gen = engine.generate(f"storm {i} " * rng.randrange(1, 6), _greedy(rng.randrange(20, 80)))
        leave_after = rng.randrange(0, 6)
        try:
            async for k, _ in _enumerate(gen):
                if k >= leave_after:
                    break
        finally:
            await gen.aclose()

    async def run():
        await asyncio.gather(*(one(i) for i in range(48)))
        return await _wait_idle(engine)

    assert asyncio.run(run()), f"blocks still held: {engine.snapshot}"
    assert len(fresh) == 48 and engine.num_open_streams() == 0


async def _enumerate(gen):
    k = 0
    async for item in gen:
        yield k, item
        k += 1


def test_refused_requests_raise_and_leave_nothing(engine, fresh):
    async def run():
        with pytest.raises(ValueError, match="max_model_len is 128"):
            await engine.add_request(list(range(3, 203)), _greedy(4))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request([10**6], _greedy(4))
        with pytest.raises(ValueError, match="already in use"):
            s = await engine.add_request("a", _greedy(50), request_id="dup")
            await engine.add_request("b", _greedy(50), request_id="dup")
        s.close()
        return await _wait_idle(engine)

    assert asyncio.run(run())
    _assert_aborted_early(fresh, 50)  # only the first "dup" ever ran


def test_a_request_that_can_never_fit_is_refused_by_the_engine_core(engine):
    blocks = engine.info.num_blocks

    async def run():
        # n=256 samples of 127 tokens each: far more blocks than the cache has.
        params = SamplingParams(n=256, temperature=1.0, max_tokens=120)
        with pytest.raises(ValueError, match=rf"need \d+ KV blocks .* the cache has {blocks}"):
            await engine.add_request("x" * 7, params)
        return await _wait_idle(engine)

    assert asyncio.run(run())


def test_call_runs_in_this_process_off_the_event_loop(engine):
    name, pid = asyncio.run(engine.call(lambda e: (threading.current_thread().name, os.getpid())))
    assert name.startswith("core-tokenizer") and pid == os.getpid()


def test_back_pressure_refuses_beyond_max_waiting_requests(model_dir):
    eng = AsyncLLMEngine(EngineArgs(model=model_dir, max_num_seqs=1, max_waiting_requests=1, **ARGS))
    try:
        async def run():
            results = await asyncio.gather(
                *(eng.add_request(f"queue {i}", _greedy(100)) for i in range(3)), return_exceptions=True
            )
            for r in results:
                if not isinstance(r, BaseException):
                    r.close()
            return results

        results = asyncio.run(run())
        refused = [r for r in results if isinstance(r, EngineOverloaded)]
        assert refused and "--max-waiting-requests 1" in str(refused[0])
        assert all(isinstance(r, EngineOverloaded) or not isinstance(r, BaseException) for r in results)
    finally:
        eng.shutdown(10)


# ---- a dead engine core -----------------------------------------------------------------------
class _FailingExecutor:
    """Delegates to the real executor; raises like a lost device on the third step that runs
    three sequences, so the test's three consumers are all attached when it fails, however
    fast the steps go (counting plain steps raced the test's sequential adds)."""

    def __init__(self, inner):
        self.inner = inner
        self.steps = 0

    def execute(self, sched):
        self.steps += len(sched.scheduled) >= 3
        if self.steps >= 3:
            raise RuntimeError("device lost")
        return self.inner.execute(sched)

    def launch(self, sched):  # the asynchronous loop launches instead of executing
        self.steps += len(sched.scheduled) >= 3
        if self.steps >= 3:
            raise RuntimeError("device lost")
        return self.inner.launch(sched)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def failing_core(args: EngineArgs) -> EngineCore:
    """An engine-core factory (runs in the child) whose executor fails once three requests run."""
    core = EngineCore.from_args(args)
    core.executor = _FailingExecutor(core.executor)
    return core


async def _fail_all(streams, match: str) -> float:
    """Drain every stream expecting EngineDeadError(match); return the seconds it took."""
    t0 = time.monotonic()
    for s in streams:
        with pytest.raises(EngineDeadError, match=match):
            async with asyncio.timeout(WAIT_S):
                async for _ in s:
                    pass
    return time.monotonic() - t0


def test_a_failing_step_reaches_every_consumer(model_dir):
    eng = AsyncLLMEngine(EngineArgs(model=model_dir, **ARGS), make_core=failing_core)
    try:
        async def run():
            streams = [await eng.add_request(f"p{i}", _greedy(50)) for i in range(3)]
            await _fail_all(streams, "device lost")

        asyncio.run(run())
        with pytest.raises(EngineDeadError, match="device lost"):
            eng.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.add_request("after", _greedy(2)))
        eng.proc.join(WAIT_S)
        assert eng.proc.exitcode == 1
    finally:
        eng.shutdown(10)


def test_sigkill_of_the_engine_core_fails_open_requests_fast(model_dir):
    eng = AsyncLLMEngine(EngineArgs(model=model_dir, **ARGS))
    try:
        async def run():
            streams = [await eng.add_request(f"k{i}", _greedy(120)) for i in range(4)]
            await streams[0].__anext__()  # generating
            os.kill(eng.proc.pid, signal.SIGKILL)
            return await _fail_all(streams, "killed by SIGKILL")

        asyncio.run(run())
        assert eng.is_dead
        with pytest.raises(EngineDeadError, match=f"pid {eng.info.pid}.* killed by SIGKILL"):
            eng.check_health()
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.add_request("after", _greedy(2)))
    finally:
        eng.shutdown(10)


def test_a_start_up_error_in_the_child_reaches_the_caller(model_dir):
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match="max-model-len 100000 exceeds the model's max_position_embeddings"):
        AsyncLLMEngine(EngineArgs(model=model_dir, **{**ARGS, "max_model_len": 100000}))
    assert time.monotonic() - t0 < WAIT_S


def slow_core(args: EngineArgs) -> EngineCore:
    """An engine-core factory whose start-up never ends (a stuck load or kernel-build lock)."""
    print(f"engine core pid {os.getpid()}", flush=True)
    while True:
        time.sleep(1)


def test_an_engine_core_still_starting_exits_when_its_front_end_dies(model_dir, tmp_path):
    import subprocess
    import sys

    path = [str(Path(__file__).parent), *sys.path]
    script = (
        f"import sys; sys.path[:0] = {path!r}\n"
        "from core.async_engine import AsyncLLMEngine\nfrom core.engine_args import EngineArgs\n"
        "from test_async_engine import slow_core\n"
        f"AsyncLLMEngine(EngineArgs(model={model_dir!r}), make_core=slow_core)\n"
    )
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = front.stdout.readline()  # printed by the child once it runs the factory
        assert line.startswith("engine core pid"), line
        pid = int(line.split()[-1])
    finally:
        front.kill()
        front.wait()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the starting engine core (pid {pid}) outlived its front end by {WAIT_S}s")


def test_a_steps_outputs_reach_every_stream_with_one_wake_up():
    """The output thread hands a step's outputs to all streams of one event loop in one
    call_soon_threadsafe (one self-pipe write), each stream getting its own output."""
    from types import SimpleNamespace

    from core.async_engine import RequestStream

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
        streams = [RequestStream(f"r{i}", loop, lambda rid: None) for i in range(5)]
        outs = [SimpleNamespace(finished=True, request_id=f"r{i}") for i in range(5)]
        t = threading.Thread(target=RequestStream.put_all, args=(list(zip(streams, outs)),))
        t.start()
        got = [[o async for o in s] for s in streams]
        t.join(WAIT_S)
        return got, wakeups

    got, wakeups = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert [[o.request_id for o in g] for g in got] == [[f"r{i}"] for i in range(5)]
    assert len(wakeups) == 1
