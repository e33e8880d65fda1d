"""End to end: ``core.LLM``, ``core generate`` and ``core serve`` on platform acme give the
CPU platform's greedy tokens on a tiny random Llama (fp32, so they must be identical)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
from acme_testkit import EMULATED, core_command, run_core
from core_acme.attention import QUERY_TILE

import core

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 5,  # ~185 tokens: several blocks, chunks
    "ka lo mi ne su ta ri po the",
]
MAX_TOKENS = 40  # every sequence crosses a 32-token block boundary while decoding
GREEDY = core.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def cpu_outputs(tiny_model):
    llm = core.LLM(model=str(tiny_model), platform="cpu", kv_cache_memory="16MiB", **COMMON)
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize(
    "engine",
    [
        dict(),  # defaults: block 32, the platform's own KV budget from the simulated memory
        dict(block_size=64, max_num_batched_tokens=48, kv_cache_memory="8MiB"),  # chunked prefill
        dict(max_num_seqs=1, kv_cache_memory="8MiB"),  # one sequence at a time
    ],
    ids=["defaults", "block64-chunked", "one-seq"],
)
def test_greedy_tokens_equal_the_cpu_platform(emulated, tiny_model, cpu_outputs, engine):
    llm = core.LLM(model=str(tiny_model), platform="acme", **COMMON, **engine)
    assert llm.engine.platform.name == "acme"
    assert llm.engine.config.cache.block_size == engine.get("block_size", 32)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(outputs[1].prompt_token_ids) > QUERY_TILE  # the prompt spans several query tiles
    assert _tokens(outputs) == _tokens(cpu_outputs)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in cpu_outputs]
    assert all(len(t) == MAX_TOKENS for t in _tokens(outputs))


def test_unsupported_block_size_is_refused_before_loading(emulated, tiny_model):
    with pytest.raises(ValueError, match="block size 16 is not supported by platform 'acme'"):
        core.LLM(model=str(tiny_model), platform="acme", block_size=16, **COMMON)


def test_core_generate_command(tiny_model, cpu_outputs):
    args = ["generate", PROMPTS[0], "--model", str(tiny_model), "--no-chat-template",
            "--max-tokens", str(MAX_TOKENS), "--dtype", "float32", "--max-model-len", "256"]
    run = run_core(*args, "--platform", "acme", env=EMULATED)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "platform acme" in run.stderr  # the engine's startup log names the platform
    # The CLI stops at EOS; the offline CPU run ignored EOS, so compare its prefix.
    cpu_text = cpu_outputs[0].outputs[0].text
    assert run.stdout.rstrip("\n") and cpu_text.startswith(run.stdout.rstrip("\n"))
    refused = run_core(*args, "--platform", "acme")  # not opted in: a clear error, no traceback
    assert refused.returncode == 2
    assert "error: platform 'acme' is not usable on this host: no Acme NPU" in refused.stderr
    assert "Traceback" not in refused.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def _wait_ready(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"core serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"core serve not ready after 180 s:\n{log.read_text()[-4000:]}")


def test_core_serve_command(tiny_model, cpu_outputs, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "CORE_NUM_THREADS": "1", **EMULATED}
    cmd = [*core_command(), "serve", str(tiny_model), "--platform", "acme", "--port", str(port),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log)
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        reply = _post(url + "/v1/completions", body)
        assert reply["choices"][0]["text"] == cpu_outputs[1].outputs[0].text
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()[-4000:]
    assert "platform acme" in log.read_text()


def test_every_step_reaches_the_npu_in_its_bucketed_shapes(emulated, tiny_model, cpu_outputs, monkeypatch):
    """Through the engine (chunked prompts, then decoding): every metadata the attention
    backend receives has bucketed sizes (padded steps, tokens still the CPU's)."""
    from core_acme.attention import AcmeAttentionBackend
    from core_acme.buckets import AcmeBuckets

    from core.batch_shape import shape_key

    seen = []
    forward = AcmeAttentionBackend.forward

    def recording(self, query, key, value, kv_cache, md):
        seen.append((shape_key(md), md.num_tokens))
        return forward(self, query, key, value, kv_cache, md)

    monkeypatch.setattr(AcmeAttentionBackend, "forward", recording)
    llm = core.LLM(model=str(tiny_model), platform="acme", max_num_batched_tokens=48,
                   kv_cache_memory="8MiB", **COMMON)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(cpu_outputs)
    b = AcmeBuckets()
    for (rows, prefills, query, decodes, width), real in seen:
        assert rows == b.pad_tokens(rows) and rows >= real
        assert all(n == 0 or n == b.pad_seqs(n) for n in (prefills, decodes))
        assert query == (b.pad_query(query) if prefills else 1)
        assert width == b.pad_blocks(width)
    assert any(key[0] > real for key, real in seen)  # steps really were padded
