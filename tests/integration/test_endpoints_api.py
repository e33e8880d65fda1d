"""/tokenize, /detokenize, several --served-model-name values, --generation-config, and the
metrics (every histogram, the dashboard's queries) against one live ``core serve`` on a tiny
random Llama whose folder carries a generation_config.json.

References are independent of the server: the HF tokenizer (``AutoTokenizer`` on the model
folder) for token ids and text; the usage counts the server reports for the histograms.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.helpers import tiny_llama_dir, wait_for_server
from tests.integration import live_server
from tests.unit.test_grafana_dashboard import DASHBOARD, dashboard_metric_names

pytestmark = pytest.mark.slow

NAMES = ("tiny", "alias-a", "team/alias-b")
GEN_CONFIG = {"temperature": 0.0, "max_new_tokens": 5, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tiny_llama_dir(tmp_path_factory.mktemp("endpoints"))
    (path / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("endpoints-log") / "server.log"
    srv = live_server.start(model_dir, log, "--served-model-name", *NAMES[1:])
    # live_server.start names the model "tiny" first; the extra names follow it.
    wait_for_server(srv.proc, srv.url, srv.log)
    yield srv
    live_server.stop(srv)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _post(server, path: str, body: dict) -> httpx2.Response:
    return httpx2.post(server.url + path, json=body, timeout=120)


# ---- /tokenize, /detokenize ------------------------------------------------------------------
def test_tokenize_prompt_matches_hf(server, hf_tok):
    text = "Hello there, tokenizer! 123"
    r = _post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf_tok.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == hf_tok.convert_ids_to_tokens(hf_tok.encode(text))
    plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tok.encode(text, add_special_tokens=False)
    assert plain["token_strs"] is None


def test_tokenize_messages_matches_the_chat_template_and_the_chat_route(server, hf_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = _post(server, "/tokenize", {"model": "alias-a", "messages": messages})
    assert r.status_code == 200, r.text
    want = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert r.json()["tokens"] == want
    no_prompt = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == list(hf_tok.apply_chat_template(messages, add_generation_prompt=False,
                                                                  tokenize=True, return_dict=False))
    chat = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)


def test_tokenize_passes_tools_and_template_kwargs_to_the_template(server, hf_tok):
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = _post(server, "/tokenize", {"messages": messages, "tools": tools, "chat_template_kwargs": {"x": 1}})
    assert r.status_code == 200, r.text
    want = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                      return_dict=False, x=1)
    assert r.json()["tokens"] == list(want)


def test_detokenize_round_trip(server, hf_tok):
    ids = hf_tok.encode("round trip ✓ text")
    r = _post(server, "/detokenize", {"model": "team/alias-b", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf_tok.decode(ids)}


@pytest.mark.parametrize("path,body,param,fragment", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None, "exactly one of prompt"),
    ("/tokenize", {}, None, "exactly one of prompt"),
    ("/tokenize", {"prompt": "a", "add_bos": True}, "add_bos", "add_bos"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model", "'tiny', 'alias-a', 'team/alias-b'"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
     None, "set add_generation_prompt to false"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens", "outside the vocabulary [0, 512)"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "greater than or equal to 0"),
])
def test_token_routes_refuse_clearly(server, path, body, param, fragment):
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert fragment in err["message"]
    if param is not None:
        assert err["param"] == param


# ---- served model names ---------------------------------------------------------------------
def test_every_served_name_is_listed_and_accepted(server):
    listed = httpx2.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in listed["data"]] == list(NAMES)
    for name in NAMES:
        assert httpx2.get(f"{server.url}/v1/models/{name}", timeout=30).json()["id"] == name
        r = _post(server, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"model": "other", "prompt": "hi"})
    assert r.status_code == 404
    assert all(repr(n) in r.json()["error"]["message"] for n in NAMES)


def _streamed_models(server, path: str, body: dict) -> list[str]:
    """The ``model`` of every chunk of a streamed response."""
    models = []
    with httpx2.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                models.append(json.loads(line[len("data: "):])["model"])
    return models


@pytest.mark.parametrize("name", NAMES)
def test_responses_name_the_alias_the_client_sent(server, name):
    """Each response (and every streamed chunk) carries the alias its request named, as
    vLLM answers; a request naming no model gets the first name."""
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion = {"model": name, "prompt": "hi", "max_tokens": 2}
    assert _post(server, "/v1/chat/completions", chat).json()["model"] == name
    assert _post(server, "/v1/completions", completion).json()["model"] == name
    usage = {"stream_options": {"include_usage": True}}
    chunks = _streamed_models(server, "/v1/chat/completions", {**chat, **usage})
    assert len(chunks) >= 2 and set(chunks) == {name}
    chunks = _streamed_models(server, "/v1/completions", {**completion, **usage, "echo": True})
    assert len(chunks) >= 2 and set(chunks) == {name}
    unnamed = {k: v for k, v in completion.items() if k != "model"}
    assert _post(server, "/v1/completions", unnamed).json()["model"] == NAMES[0]


# ---- --generation-config auto ---------------------------------------------------------------
def _completion(server, **fields) -> dict:
    r = _post(server, "/v1/completions", {"prompt": "The weather", "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_generation_config_defaults_apply_where_the_request_is_silent(server):
    # temperature 0 from generation_config.json: every seed gives the greedy text.
    greedy = _completion(server, temperature=0.0, max_tokens=12)["choices"][0]["text"]
    defaults = {_completion(server, seed=s, max_tokens=12)["choices"][0]["text"] for s in range(4)}
    assert defaults == {greedy}
    # an explicit temperature wins: sampled texts leave the greedy one
    sampled = {_completion(server, seed=s, temperature=1.0, max_tokens=12)["choices"][0]["text"] for s in range(6)}
    assert sampled - {greedy}
    # max_new_tokens is the default max_tokens of a chat request that sets none; an explicit one wins
    chat = {"messages": [{"role": "user", "content": "hello"}], "ignore_eos": True}
    assert _post(server, "/v1/chat/completions", chat).json()["usage"]["completion_tokens"] == 5
    assert _post(server, "/v1/chat/completions", {**chat, "max_tokens": 9}).json()["usage"]["completion_tokens"] == 9


# ---- metrics --------------------------------------------------------------------------------
def _scrape(server) -> dict[str, float]:
    """sample name + sorted labels (model_name dropped) -> value."""
    text = httpx2.get(server.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
            out.setdefault(s.name, 0.0)
    return out


def _value(samples: dict[str, float], name: str, **labels) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return samples[f"{name}{{{key}}}"]


def test_request_histograms_follow_the_requests(server):
    before = _scrape(server)
    usages = []
    for i, n_tokens in enumerate((3, 7, 11)):
        r = _completion(server, prompt="count " * (i + 1), max_tokens=n_tokens, temperature=0.0)
        usages.append(r["usage"])
    after = _scrape(server)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("core:request_prompt_tokens_count") == 3
    assert delta("core:request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usages)
    assert delta("core:request_generation_tokens_sum") == sum(u["completion_tokens"] for u in usages)
    assert delta("core:request_params_n_sum") == 3
    # one inter-token gap per token after each sample's first
    assert delta("core:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_front_end_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert delta(f"core:{name}_count") == 3, name
    # queue + prefill + decode is the end-to-end time (the same timestamps, split)
    parts = sum(delta(f"core:request_{k}_time_seconds_sum") for k in ("queue", "prefill", "decode"))
    assert parts == pytest.approx(delta("core:e2e_request_latency_seconds_sum"), abs=1e-6)
    # the engine core's receipt (its own clock) comes before its scheduling of the request
    assert delta("core:request_front_end_time_seconds_sum") <= delta("core:request_queue_time_seconds_sum")
    assert delta("core:request_success_total", finished_reason="length") == 3
    assert 0.0 <= _value(after, "core:kv_cache_usage_perc") <= 1.0
    assert 0.0 <= _value(after, "core:prefix_cache_hit_rate") <= 1.0


def test_every_dashboard_metric_is_exported(server):
    # one refused request, so the error counter has a series too
    assert _post(server, "/v1/completions", {"model": "other", "prompt": "x"}).status_code == 404
    exported = {key for key in _scrape(server) if "{" not in key}
    wanted = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert len(wanted) >= 15
    missing = sorted(wanted - exported)
    assert not missing, f"{DASHBOARD.name} queries metrics /metrics does not export: {missing}"


def test_embeddings_need_task_embed(server):
    r = _post(server, "/v1/embeddings", {"input": "x"})
    assert r.status_code == 400
    assert "start it with --task embed" in r.json()["error"]["message"]
