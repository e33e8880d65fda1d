"""No silent ignores: the request-field table of docs/serving.md is pinned to the request
models, and the live server does what the table says: unknown top-level fields are named in
``X-Ignored-Fields``, unknown nested fields and rejected fields are a 400, and
``prompt_logprobs``, ``echo`` with ``logprobs`` and ``continue_final_message`` are honoured
(logprobs against HF transformers, prompts against the HF tokenizer's own chat template
rendering, output against the offline engine)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx2
import pytest
import torch

from core.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from core.sampling_params import SamplingParams
from tests.helpers import tiny_llama_dir, wait_for_server
from tests.integration import live_server

ROOT = Path(__file__).resolve().parents[2]
POLICIES = {"honoured", "partly", "rejected"}


def _table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "serving.md").read_text()
    body = text.split("<!-- field-table:start -->")[1].split("<!-- field-table:end -->")[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = cells[0].strip("`")
        assert name not in rows, f"{name} is in the table twice"
        rows[name] = (cells[1], cells[2])
    return rows


def test_the_table_lists_every_request_field_once_with_its_endpoint():
    rows = _table()
    documented = {"completions": set(), "chat": set()}
    for name, (endpoint, policy) in rows.items():
        assert policy in POLICIES, (name, policy)
        assert endpoint in ("both", "completions", "chat"), (name, endpoint)
        for e in ("completions", "chat") if endpoint == "both" else (endpoint,):
            documented[e].add(name)
    assert documented["completions"] == set(CompletionRequest.model_fields)
    assert documented["chat"] == set(ChatCompletionRequest.model_fields)


def test_every_message_field_is_documented():
    text = (ROOT / "docs" / "serving.md").read_text()
    paragraph = text.split("Message fields (`messages[i]`):")[1].split("\n\n")[0]
    assert {f for f in ChatMessage.model_fields if f"`{f}`" in paragraph} == set(ChatMessage.model_fields)


# ---- the live server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("fields"), seed=13)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = live_server.start(model_dir, tmp_path_factory.mktemp("fields-log") / "server.log")
    try:
        wait_for_server(srv.proc, srv.url, srv.log)
        yield srv
    finally:
        live_server.stop(srv)


def _post(server, path: str, body: dict) -> httpx2.Response:
    return httpx2.post(server.url + path, json=body, timeout=120)


def test_unknown_top_level_fields_are_named_in_a_header(server):
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "best_of_the_best": 3, "zeta": None})
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "best_of_the_best, zeta"
    with httpx2.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True,
                             "reasoning_effort": "low"}) as s:
        assert s.status_code == 200 and s.headers["X-Ignored-Fields"] == "reasoning_effort"
        assert "[DONE]" in "".join(s.iter_text())
    plain = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert "X-Ignored-Fields" not in plain.headers


@pytest.mark.parametrize("body,where", [
    ({"messages": [{"role": "user", "content": "x", "cache_control": {}}]}, "messages[0].cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}, "examples": []}}]}, "tools[0].function.examples"),
])
def test_unknown_nested_fields_are_refused(server, body, where):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert where in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
                              "add_generation_prompt": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
])
def test_refusals_name_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def _hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p: the distribution of token p + 1


def test_prompt_logprobs_match_hf(server, hf_model):
    ids = [1, 40, 77, 300, 12, 99, 250]
    r = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    got = r["choices"][0]["prompt_logprobs"]
    ref = _hf_prompt_logprobs(hf_model, ids)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        entry = got[p]
        assert str(ids[p]) in entry and len(entry) in (2, 3)  # the top 2 plus the prompt token
        for tid, lp in entry.items():
            assert math.isclose(lp["logprob"], ref[p - 1, int(tid)].item(), abs_tol=1e-4)
        top = torch.topk(ref[p - 1], 2).indices.tolist()
        assert {int(t) for t, lp in entry.items() if lp["rank"] <= 2} == set(top)
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                  "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_echo_with_logprobs_puts_the_prompt_first(server, hf_model):
    ids = [1, 72, 101, 108, 108, 111]
    r = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1,
                                          "temperature": 0}).json()
    choice = r["choices"][0]
    choice_lp = choice["logprobs"]
    n = len(ids)
    assert len(choice_lp["tokens"]) == n + 3 and choice_lp["token_logprobs"][0] is None
    assert choice_lp["top_logprobs"][0] is None
    ref = _hf_prompt_logprobs(hf_model, ids)
    for p in range(1, n):
        assert math.isclose(choice_lp["token_logprobs"][p], ref[p - 1, ids[p]].item(), abs_tol=1e-4)
    text = choice["text"]
    for tok, off in zip(choice_lp["tokens"], choice_lp["text_offset"]):
        assert text.startswith(tok, off) or tok in ("<s>", "\ufffd") or not tok, (tok, off, text)
    assert choice_lp["text_offset"] == sorted(choice_lp["text_offset"])
    streamed = []
    with httpx2.stream("POST", server.url + "/v1/completions", timeout=120,
                       json={"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0,
                             "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += (c["logprobs"] or {}).get("token_logprobs", [])
    assert streamed == choice_lp["token_logprobs"]


def test_continue_final_message_continues_the_assistant_turn(server, model_dir):
    from transformers import AutoTokenizer

    from core.entrypoints.llm import LLM

    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                               "max_tokens": 6, "temperature": 0}).json()
    tok = AutoTokenizer.from_pretrained(model_dir)
    want = tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                   tokenize=True, return_dict=False)
    assert r["usage"]["prompt_tokens"] == len(want)
    assert re.search("Once upon$", tok.decode(want))  # the turn is left open, not closed
    offline = LLM(model=str(model_dir), platform="cpu", dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    out = offline.generate([list(want)], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert r["choices"][0]["message"]["content"] == out.outputs[0].text
