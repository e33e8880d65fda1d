"""The OpenAI-compatible server, run for real as a subprocess and driven with the official
``openai`` client (plus raw HTTP where the client hides what we check).

Two servers per module, both on a tiny random Llama (tests/helpers.py):

* ``server``: the main one (max_model_len 256, max_num_seqs 32);
* ``keyed``: ``--api-key``, ``--max-num-seqs 2 --max-waiting-requests 2``; the last test sends
  it SIGTERM mid-stream and checks the graceful exit.

References are independent of the server: HF ``transformers`` logits for logprobs, the HF
tokenizer for usage counts, the offline ``LLM`` (no HTTP, no async engine) for greedy streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
import torch

from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir, wait_for_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
MODEL = "tiny"
API_KEY = "s3cret-key"


# ---- servers --------------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir: Path, log: Path, *extra: str) -> Server:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CORE_NUM_THREADS": "1", "CORE_PLATFORM": "cpu"}
    cmd = [sys.executable, "-m", "core.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
           "--kv-cache-memory", "32MiB", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Server(proc, f"http://127.0.0.1:{port}", log)


def _wait_ready(server: Server) -> None:
    # Follows the server's log (kernel build, model load) rather than a fixed clock.
    wait_for_server(server.proc, server.url, server.log)


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("openai"), max_position_embeddings=MAX_MODEL_LEN * 2)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    main = _start(model_dir, logs / "main.log", "--max-num-seqs", "32")
    keyed = _start(model_dir, logs / "keyed.log", "--api-key", API_KEY, "--max-num-seqs", "2",
                   "--max-waiting-requests", "2", "--shutdown-grace-period", "20")
    try:
        _wait_ready(main)
        _wait_ready(keyed)
        yield main, keyed
    finally:
        _stop(main)
        _stop(keyed)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def offline(model_dir):
    from core.entrypoints.llm import LLM

    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, dtype="float32", platform="cpu",
               kv_cache_memory="32MiB")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


# ---- basics ----------------------------------------------------------------------------------
def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_matches_offline_and_usage(client, hf_tok, offline):
    prompt = "Hello world, the quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(hf_tok(prompt).input_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_matches_offline_and_usage(client, hf_tok, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=9, temperature=0)
    ref = offline.chat(messages, _greedy(9), use_tqdm=False)[0].outputs[0]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    expected_prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_streaming_completion(client):
    kw = dict(model=MODEL, prompt="The lazy dog", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_chat(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_n2_streaming_and_not(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=6, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts == {c.index: c.text for c in r.choices}  # same seed, same samples


def test_n2_samples_are_independent(client):
    """n samples of one request differ, with and without a seed (OpenAI/vLLM semantics: the
    seed makes the *set* of samples reproducible, it does not make them all the same)."""
    for seed in (None, 7):
        r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=1.0, seed=seed,
                                      n=2, extra_body={"ignore_eos": True})
        # Two 6-token samples from a near-flat 512-token distribution collide with
        # probability ~512**-6 unless they share their random draws.
        assert r.choices[0].text != r.choices[1].text, f"seed={seed}: both samples are {r.choices[0].text!r}"


def test_multiple_prompts_with_echo(client, hf_tok):
    prompts = ["The lazy dog", "Hello world"]
    kw = dict(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=11, echo=True,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]  # prompt_index * n + sample
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2]) and len(c.text) > len(prompts[c.index // 2])
    assert r.usage.prompt_tokens == sum(len(hf_tok(p).input_ids) for p in prompts)
    assert r.usage.completion_tokens == 12
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_chat_n2(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=5, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_stop_strings(client):
    base = dict(model=MODEL, prompt="Stop test:", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    # A stop string taken from the middle of the greedy text: the output must end right
    # before its first occurrence (found even if split across tokens).
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3]
                and text[i:i + 3].strip())
    expected = text[: text.index(stop)]
    r = client.completions.create(**base, stop=[stop, "never-generated-xyz"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True)
                       if c.choices)
    assert streamed == expected


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="Random:", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=4321).choices[0].text
    assert a == b
    assert a != c


def _hf_greedy(model_dir: Path, prompt_ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by HF transformers and the log-softmax rows that chose it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, rows = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            rows.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt_ids):], torch.stack(rows)


def test_completion_logprobs_match_hf(client, model_dir, hf_tok):
    prompt_ids = hf_tok("The quick brown fox jumps").input_ids
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    gen, rows = _hf_greedy(model_dir, prompt_ids, 6)
    assert r.choices[0].text == hf_tok.decode(gen, skip_special_tokens=True)
    lp = r.choices[0].logprobs
    assert lp.tokens == [hf_tok.decode([t]) for t in gen]
    assert lp.token_logprobs == pytest.approx(rows.max(dim=-1).values.tolist(), abs=2e-3)
    for i, row in enumerate(rows):
        # top 3 plus the sampled token (greedy: among them), keyed by token text; tokens
        # sharing a text (e.g. partial UTF-8 bytes) keep the likelier entry
        expected: dict[str, float] = {}
        for lp_value, tid in zip(*row.topk(3)):
            expected.setdefault(hf_tok.decode([int(tid)]), float(lp_value))
        assert lp.top_logprobs[i] == pytest.approx(expected, abs=2e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy picks the top token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_penalties_bias_and_user_accepted(client, hf_tok):
    # logit_bias +100 on one token makes greedy decoding emit only that token.
    tid = hf_tok(" fox", add_special_tokens=False).input_ids[0]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, logit_bias={str(tid): 100},
                                  presence_penalty=0.5, frequency_penalty=0.5, top_p=0.9, user="u-1",
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == hf_tok.decode([tid] * 4)


# ---- concurrency and aborts ------------------------------------------------------------------
async def _stream_text(aclient: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    text, reason = "", None
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def test_32_concurrent_streams_match_offline(server, offline):
    prompts = [f"Request {i}: the {w} fox" for i, w in enumerate(["quick", "lazy", "brown", "red"] * 8)]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(_stream_text(ac, p, 12) for p in prompts))

    got = asyncio.run(run())
    ref = offline.generate(prompts, _greedy(12), use_tqdm=False)
    assert [g[0] for g in got] == [o.outputs[0].text for o in ref]
    assert [g[1] for g in got] == [o.outputs[0].finish_reason for o in ref]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_abort_storm_frees_everything(server):
    rng = random.Random(0)
    cut = {i: rng.randint(0, 8) for i in rng.sample(range(100), 50)}  # request -> chunks read before closing

    async def one(ac: openai.AsyncOpenAI, i: int) -> int | None:
        # Closed streams ask for more tokens than they will ever read, so they are still
        # running when the client goes away.
        stream = await ac.completions.create(model=MODEL, prompt=f"storm {i}", max_tokens=200 if i in cut else 48,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True})
        usage, seen = None, 0
        async for chunk in stream:
            if i in cut and seen >= cut[i]:
                break
            seen += 1
            usage = chunk.usage or usage
        await stream.close()
        return None if i in cut else usage.completion_tokens

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            results = await asyncio.gather(*(one(ac, i) for i in range(100)))
            await asyncio.sleep(0.2)  # let the client's abandoned stream generators finalize in the loop
            return results

    before = _finished_counts(httpx2.get(server.url + "/metrics").text)
    results = asyncio.run(run())
    assert [r for i, r in enumerate(results) if i not in cut] == [48] * 50
    deadline = time.monotonic() + 20
    while True:
        text = httpx2.get(server.url + "/metrics").text
        running, kv = _metric(text, "core:num_requests_running"), _metric(text, "core:kv_cache_usage_perc")
        waiting = _metric(text, "core:num_requests_waiting")
        if (running, waiting, kv) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (running, waiting, kv) == (0, 0, 0)
    after = _finished_counts(text)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # Every request ended exactly once: the 50 read to the end by length, the closed ones by
    # abort (or by length when they finished before the close reached the server).
    assert delta.get("abort", 0) + delta.get("length", 0) == 100 and delta.get("stop", 0) == 0, delta
    assert delta["abort"] >= 1 and delta["length"] >= 50, delta


def _finished_counts(metrics_text: str) -> dict[str, float]:
    pattern = r'^core:request_success_total\{[^}]*finished_reason="(\w+)"[^}]*\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, metrics_text, re.M)}


# ---- errors ----------------------------------------------------------------------------------
def _error(resp: httpx2.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_error_shapes(server, hf_tok):
    url = server.url
    long_prompt = list(range(3, 3 + 300))
    e = _error(httpx2.post(url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400)
    assert "300" in e["message"] and str(MAX_MODEL_LEN) in e["message"]
    e = _error(httpx2.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1}), 400)
    assert e["param"] == "temperature" and e["type"] == "invalid_request_error"
    e = _error(httpx2.post(url + "/v1/chat/completions", json={"model": MODEL}), 400)
    assert e["param"] == "messages"
    _error(httpx2.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    e = _error(httpx2.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and "gpt-4" in e["message"]
    e = _error(httpx2.post(url + "/v1/completions", json={"prompt": "x", "logit_bias": {"abc": 1}}), 400)
    assert e["param"].startswith("logit_bias")
    e = _error(httpx2.post(url + "/v1/completions", json={"prompt": "x", "logit_bias": {"99999": 1}}), 400)
    assert "99999" in e["message"]
    _error(httpx2.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "top_logprobs": 2}), 400)
    _error(httpx2.post(url + "/v1/completions", json={"prompt": "x", "n": 33}), 400)  # > --max-num-seqs
    _error(httpx2.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "min_tokens": 9}), 400)
    _error(httpx2.post(url + "/v1/completions", json={"prompt": []}), 400)
    _error(httpx2.get(url + "/v1/nothing-here"), 404)
    _error(httpx2.get(url + "/v1/completions"), 405)
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt="x", top_p=5)


def test_health_metrics_and_docs(server, client):
    assert httpx2.get(server.url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    text = httpx2.get(server.url + "/metrics").text
    names = set(re.findall(r"^# TYPE (core:\S+) ", text, re.M))
    assert {"core:num_requests_running", "core:num_requests_waiting", "core:kv_cache_usage_perc",
            "core:prompt_tokens_total", "core:generation_tokens_total", "core:time_to_first_token_seconds",
            "core:time_per_output_token_seconds", "core:e2e_request_latency_seconds", "core:num_preemptions_total",
            "core:prefix_cache_hits_total", "core:prefix_cache_queries_total"} <= names
    assert _metric(text, "core:generation_tokens_total") > 0
    docs = (ROOT / "docs" / "serving.md").read_text()
    # *_created series are the standard creation timestamps prometheus-client adds
    undocumented = [n for n in names if n not in docs and not n.endswith("_created")]
    assert not undocumented, f"metrics missing from docs/serving.md: {undocumented}"
    schema = httpx2.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])


def test_bench_serve_online_and_offline(server, model_dir, tmp_path, caplog):
    """`core bench serve` against the server, then the same workload offline."""
    from core.entrypoints.cli import main

    caplog.set_level(logging.INFO)

    common = ["bench", "serve", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
              "--token-range", "3", "500", "--seed", "3", "--request-rate", "20", "--save-detailed"]
    assert main([*common, "--base-url", server.url, "--output-json", str(tmp_path / "on.json")]) == 0
    # the HTTP client's per-request INFO lines stay out of the report
    assert not [r for r in caplog.records if r.name.startswith("httpx2") and r.levelno < logging.WARNING]
    assert main([*common, "--offline", "--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN),
                 "--kv-cache-memory", "32MiB", "--platform", "cpu", "--output-json", str(tmp_path / "off.json")]) == 0
    for name in ("on", "off"):
        r = json.loads((tmp_path / f"{name}.json").read_text())
        assert (r["completed"], r["failed"]) == (6, 0)
        assert r["output_tokens_per_s"] == pytest.approx(6 * 8 / r["elapsed_s"], rel=0.01)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        reqs = r["requests"]  # --save-detailed: one record per prompt, the summary's own numbers
        assert len(reqs) == 6 and all(q["ok"] and q["output_tokens"] == 8 for q in reqs)
        assert all(0 < q["ttft_ms"] <= q["e2e_ms"] and 0 <= q["sent_s"] <= r["elapsed_s"] for q in reqs)
        assert max(q["ttft_ms"] for q in reqs) == pytest.approx(r["ttft_ms"]["p99"], rel=0.05, abs=1.0)
    # online, the server's own split of the same six requests (from /metrics): in order, and
    # inside what the client saw (its clock starts before the send and stops after the receipt)
    split = json.loads((tmp_path / "on.json").read_text())["server_ms"]
    assert split["requests"] == 6
    assert 0 <= split["front_end"] <= split["queue"] <= split["ttft"] <= split["e2e"]
    assert split["ttft"] <= json.loads((tmp_path / "on.json").read_text())["ttft_ms"]["mean"] + 0.01
    assert "server_ms" not in json.loads((tmp_path / "off.json").read_text())


def test_bench_serve_reports_the_servers_refusal(server, tmp_path, capsys):
    """A prompt the server refuses (longer than its max_model_len) stops the benchmark at the
    warm-up request with the server's own message, instead of a run of failures."""
    from core.entrypoints.cli import main

    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--input-len",
               str(MAX_MODEL_LEN + 10), "--output-len", "4", "--token-range", "3", "500",
               "--output-json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "warm-up request" in err and "HTTP 400" in err and str(MAX_MODEL_LEN + 10) in err, err
    assert not (tmp_path / "x.json").exists()


def test_schemathesis_finds_no_5xx(server, tmp_path):
    """Bounded, seeded fuzzing of every operation in /openapi.json. Last on the main server:
    a request that kills the engine turns everything after it into 503s."""
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
           "--phases", "examples,coverage,fuzzing", "--max-examples", "30", "--seed", "1",  # no --max-time: the same cases every run
           # one worker: hypothesis' lambda pretty-printer trips a CPython 3.11 ast bug in threads
           "--request-timeout", "30", "--workers", "1", "--suppress-health-check", "all",
           "--report-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    if res.returncode != 0:
        pytest.fail(f"schemathesis failed:\n{res.stdout[-8000:]}\n{res.stderr[-2000:]}")
    assert httpx2.get(server.url + "/health").status_code == 200


# ---- the keyed server: auth, overload, SIGTERM -------------------------------------------------
def test_api_key(keyed):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    e = _error(httpx2.post(keyed.url + "/v1/completions", json=body), 401)
    assert e["code"] == "invalid_api_key"
    _error(httpx2.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx2.get(keyed.url + "/v1/models", headers={"Authorization": f"Basic {API_KEY}"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    ok = httpx2.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200, ok.text
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL
    assert httpx2.get(keyed.url + "/health").status_code == 200
    assert httpx2.get(keyed.url + "/metrics").status_code == 200


def test_overload_503_with_retry_after(keyed):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "load", "max_tokens": 120, "ignore_eos": True}

    async def run():
        async with httpx2.AsyncClient(timeout=120, headers=headers) as c:
            return await asyncio.gather(*(c.post(keyed.url + "/v1/completions", json=body) for _ in range(12)))

    resps = asyncio.run(run())
    codes = sorted(r.status_code for r in resps)
    # 2 running + at most 2 waiting; requests that find 2 waiting are refused
    assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
    refused = next(r for r in resps if r.status_code == 503)
    assert refused.headers["retry-after"] == "1"
    assert _error(refused, 503)["code"] == "overloaded"


def test_sigterm_finishes_inflight_then_exits_0(keyed):
    """Last test of the module: the keyed server is gone afterwards."""
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt="zebra-marker", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = [next(iter(stream))]
    keyed.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx2.HTTPError):  # no longer accepting connections
        httpx2.get(keyed.url + "/health", timeout=2)
    chunks += list(stream)
    assert chunks[-1].usage.completion_tokens == 200  # the in-flight request finished
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert keyed.proc.wait(30) == 0, keyed.log_tail()
    log = keyed.log.read_text()
    assert "Traceback" not in log, log[-4000:]
    assert "zebra" not in log  # prompts are not logged without --log-prompts
    assert "cmpl-" in log  # but requests are
