"""``core serve`` with its engine core in a separate process, driven by the real ``openai``
client on a tiny random Llama (CPU):

* the engine core runs in a child process of the server (its pid differs);
* 64 concurrent streams give exactly the offline engine's greedy outputs;
* an abort storm (clients leaving mid-stream) leaves every KV block free;
* a request that can never fit the KV cache is a 400 with the numbers;
* SIGKILL of the engine-core process fails in-flight requests fast with a clear error, and
  ``/health`` answers 503 (nothing hangs: every wait here is bounded).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest

from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir, wait_for_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
MODEL = "tiny"
WAIT_S = 120.0
"""Bound on every wait for a request or a state (a loaded 2-core CI box)."""


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def engine_core_pid(self) -> int:
        m = re.search(r"engine core running in process (\d+)", self.log_text())
        assert m, f"no engine-core pid in the log:\n{self.log_text()[-3000:]}"
        return int(m.group(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir: Path, log: Path, *extra: str) -> Server:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CORE_NUM_THREADS": "1", "CORE_PLATFORM": "cpu"}
    cmd = [sys.executable, "-m", "core.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    wait_for_server(proc, server.url, log)  # follows the log: a kernel build may be running
    return server


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("engine-process"), max_position_embeddings=MAX_MODEL_LEN * 2)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = _start(model_dir, tmp_path_factory.mktemp("logs") / "main.log", "--max-num-seqs", "64",
               "--kv-cache-memory", "32MiB")
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def small(model_dir, tmp_path_factory):
    """16 usable KV blocks of 16 tokens (exactly one full-length sequence)."""
    s = _start(model_dir, tmp_path_factory.mktemp("logs") / "small.log", "--block-size", "16",
               "--num-blocks-override", "17", "--max-num-seqs", "16")
    yield s
    _stop(s)


def _metrics(server: Server) -> dict[str, float]:
    text = httpx2.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(core:\w+)\{model_name="tiny"\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _wait_all_free(server: Server) -> dict[str, float]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        m = _metrics(server)
        if (m["core:kv_cache_usage_perc"], m["core:num_requests_running"], m["core:num_requests_waiting"]) == (0, 0, 0):
            return m
        time.sleep(0.1)
    pytest.fail(f"KV blocks still held after {WAIT_S}s: {_metrics(server)}")


# ---- the process split -----------------------------------------------------------------------------
def test_the_engine_core_is_a_separate_child_process(server):
    pid = server.engine_core_pid()
    assert pid != server.proc.pid
    os.kill(pid, 0)  # alive
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    assert ppid == server.proc.pid


def test_64_concurrent_streams_match_the_offline_engine(server, model_dir):
    from core.entrypoints.llm import LLM

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "stream", "token", "river", "cloud", "seven", "x"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(2, 12))) for _ in range(64)]
    lengths = [rng.randrange(4, 24) for _ in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, str]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        try:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await client.close()

    streamed = asyncio.run(run())
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, dtype="float32", platform="cpu",
              kv_cache_memory="32MiB")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    offline = llm.generate(prompts, params, use_tqdm=False)
    assert [s[1] for s in streamed] == ["length"] * 64
    assert [s[0] for s in streamed] == [o.outputs[0].text for o in offline]
    _wait_all_free(server)


# ---- aborts and refusals -------------------------------------------------------------------------
def test_abort_storm_leaves_every_kv_block_free(small):
    rng = random.Random(1)

    async def leave_early(client: httpx2.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"storm {i} " * rng.randrange(1, 8), "max_tokens": rng.randrange(20, 120),
                "temperature": 0, "ignore_eos": True, "stream": True}
        chunks = rng.randrange(0, 5)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            k = 0
            async for _ in r.aiter_lines():
                k += 1
                if k > chunks:
                    break  # closing the response disconnects: the server must abort

    async def run():
        async with httpx2.AsyncClient(base_url=small.url, timeout=WAIT_S) as client:
            await asyncio.gather(*(leave_early(client, i) for i in range(40)))

    asyncio.run(run())
    m = _wait_all_free(small)
    assert m["core:num_requests_swapped"] == 0
    # and the engine still serves
    r = httpx2.post(small.url + "/v1/completions", timeout=WAIT_S,
                    json={"model": MODEL, "prompt": "after the storm", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_request_that_can_never_fit_the_cache_is_a_400_with_the_numbers(small):
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 50, "n": 5, "temperature": 1}
    r = httpx2.post(small.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert re.search(r"5 sample\(s\) of up to \d+ tokens need 20 KV blocks of 16 tokens but the cache has 16", msg), msg
    assert "lower max_tokens or n" in msg
    _wait_all_free(small)


# ---- a dead engine core ----------------------------------------------------------------------------
def test_sigkill_of_the_engine_core_fails_requests_fast_and_health_is_503(model_dir, tmp_path):
    s = _start(model_dir, tmp_path / "kill.log", "--kv-cache-memory", "32MiB")
    try:
        pid = s.engine_core_pid()

        async def stream_until_error(client: openai.AsyncOpenAI, i: int, started: asyncio.Event) -> BaseException:
            try:  # a request not yet answered gets a 503, a streaming one an error event
                stream = await client.completions.create(model=MODEL, prompt=f"doomed {i}", max_tokens=200,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    started.set()
            except openai.APIError as e:
                return e
            pytest.fail("the stream ended normally after the engine core was killed")

        async def run():
            client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
            try:
                started = asyncio.Event()
                tasks = [asyncio.ensure_future(stream_until_error(client, i, started)) for i in range(4)]
                await asyncio.wait_for(started.wait(), WAIT_S)
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                errors = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
                return errors, time.monotonic() - t0
            finally:
                await client.close()

        errors, took = asyncio.run(run())
        assert all("killed by SIGKILL" in str(e) for e in errors), [str(e) for e in errors]
        assert took < WAIT_S
        h = httpx2.get(s.url + "/health", timeout=10)
        assert h.status_code == 503 and "killed by SIGKILL" in h.json()["error"]["message"]
        r = httpx2.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "restart the server" in r.json()["error"]["message"]
        assert s.proc.poll() is None  # the API server stays up to answer 503s
    finally:
        _stop(s)
    assert s.proc.returncode == 0


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_engine_core_exits_when_the_server_is_killed(model_dir, tmp_path):
    s = _start(model_dir, tmp_path / "orphan.log", "--kv-cache-memory", "32MiB")
    pid = s.engine_core_pid()
    s.proc.kill()  # no shutdown: the child must notice on its own
    s.proc.wait()
    deadline = time.monotonic() + WAIT_S
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the engine core (pid {pid}) outlived its server by {WAIT_S}s")
