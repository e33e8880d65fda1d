"""AsyncLLMEngine on a real LLMEngine (tiny random Llama): every output delivered, aborts
free the KV cache, refusals and engine failures reach the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.async_engine import AsyncLLMEngine, EngineDeadError
from core.engine import LLMEngine
from core.engine_args import EngineArgs
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir

ARGS = dict(max_model_len=128, dtype="float32", platform="cpu", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_llama_dir(tmp_path_factory.mktemp("async")))


@pytest.fixture
def finished():
    """Finished outputs seen by the engine thread's on_finished hook."""
    return []


@pytest.fixture
def engine(model_dir, finished):
    eng = AsyncLLMEngine(LLMEngine.from_args(EngineArgs(model=model_dir, **ARGS)), on_finished=finished.append)
    yield eng
    eng.shutdown(10)


def _assert_aborted_early(finished, n_max: int) -> None:
    assert len(finished) == 1
    comp = finished[0].outputs[0]
    assert comp.finish_reason == "abort" and len(comp.token_ids) < n_max


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def _collect(engine: AsyncLLMEngine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_streams_are_complete_and_match_the_sync_engine(engine, model_dir):
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
    assert engine.num_open_streams() == 0


def test_consumer_leaving_early_aborts_and_frees_blocks(engine, finished):
    async def run():
        gen = engine.generate("leave early", _greedy(100))
        first = await gen.__anext__()
        await gen.aclose()
        return first

    first = asyncio.run(run())
    assert not first.finished
    deadline = asyncio.run(_wait_idle(engine))
    assert deadline, f"engine not idle: {engine.snapshot}"
    s = engine.snapshot.scheduler
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert engine.num_open_streams() == 0
    _assert_aborted_early(finished, 100)


async def _wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        s = engine.snapshot.scheduler
        if s is not None and s.num_running == 0 and s.num_waiting == 0 and engine.num_open_streams() == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def test_cancelled_consumer_aborts(engine, finished):
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
    _assert_aborted_early(finished, 100)


def test_refused_request_raises_and_leaves_nothing(engine, finished):
    async def run():
        with pytest.raises(ValueError, match="max_model_len is 128"):
            await engine.add_request(list(range(3, 203)), _greedy(4))
        with pytest.raises(ValueError, match="already in use"):
            s = await engine.add_request("a", _greedy(50), request_id="dup")
            await engine.add_request("b", _greedy(50), request_id="dup")
        s.close()
        return await _wait_idle(engine)

    assert asyncio.run(run())
    _assert_aborted_early(finished, 50)  # only the first "dup" ever ran


def test_call_runs_on_the_engine_thread(engine):
    name = asyncio.run(engine.call(lambda e: threading.current_thread().name))
    assert name == "core-engine"


def test_engine_failure_reaches_every_consumer(engine, monkeypatch):
    # Simulate a device failure inside a step (the only way to break a healthy engine).
    def broken_step():
        raise RuntimeError("device lost")

    async def run():
        streams = [await engine.add_request(f"p{i}", _greedy(50)) for i in range(3)]
        monkeypatch.setattr(engine.engine, "step", broken_step)
        errors = []
        for s in streams:
            with pytest.raises(EngineDeadError, match="device lost") as exc:
                async for _ in s:
                    pass
            errors.append(exc.value)
        return errors

    assert len(asyncio.run(run())) == 3
    assert engine.is_dead
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.add_request("after", _greedy(2)))
