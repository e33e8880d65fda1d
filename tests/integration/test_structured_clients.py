"""Structured output, tool calls and reasoning through ``core serve`` (a subprocess on a tiny
random Llama), driven by unmodified clients: the ``openai`` SDK (``beta.chat.completions.parse``
with a pydantic model, tools with streaming, vLLM's fields through ``extra_body``) and
``langchain-openai`` (``with_structured_output``, ``bind_tools``).

The server runs with a chat template that renders tools and tool calls (so the Hermes parser is
guessed from it: no ``--tool-call-parser``) and ``--reasoning-parser qwen3``. A random model
writes neither tool-call markup nor ``<think>`` on its own, so the ``auto`` and reasoning
paths are driven by a grammar that makes it write them (``structured_outputs.regex``); the
parsed result is checked against what the grammar forced. Every JSON answer is validated with
``jsonschema``.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import tiny_llama_dir, wait_for_server
from tests.integration import live_server
from tests.unit.structured_schemas import SCHEMAS, bounded_numbers

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024  # tool definitions in a byte-level prompt take a few hundred tokens

TEMPLATE = (
    "{%- if tools %}<s>tools: {{ tools | tojson }}</s>{% endif -%}"
    "{%- for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor -%}"
    "{%- if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}</s>{% endfor -%}"
    "{%- if add_generation_prompt %}<s>assistant: "
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif -%}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,8}", "days": [1-7]\}\}\n</tool_call>'


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-clients")
    model = tiny_llama_dir(root, seed=9, max_position_embeddings=MAX_MODEL_LEN)
    template = root / "tools.jinja"
    template.write_text(TEMPLATE)
    srv = live_server.start(model, root / "server.log", "--chat-template", str(template),
                            "--reasoning-parser", "qwen3", "--max-num-seqs", "64", max_model_len=MAX_MODEL_LEN)
    try:
        wait_for_server(srv.proc, srv.url, srv.log)
        yield srv
    finally:
        live_server.stop(srv)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(content: str = "hi") -> list[dict]:
    return [{"role": "user", "content": content}]


# ---- JSON -------------------------------------------------------------------------------------
def test_sdk_parse_with_a_pydantic_model(client):
    for temperature in (0.0, 1.0):
        done = client.beta.chat.completions.parse(model=live_server.MODEL, messages=_chat("Who?"),
                                                  response_format=Person, max_tokens=120, temperature=temperature,
                                                  seed=3)
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Person), msg.content
        jsonschema.validate(json.loads(msg.content), Person.model_json_schema())


def test_schema_suite_validates_over_http_at_temperature_0_and_1(server):
    async def run() -> list[tuple[str, float, dict, str, str]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(name: str, temperature: float):
            schema = bounded_numbers(SCHEMAS[name])
            r = await aclient.chat.completions.create(
                model=live_server.MODEL, messages=_chat("JSON please"), max_tokens=200, temperature=temperature,
                seed=5, response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
            return name, temperature, schema, r.choices[0].message.content, r.choices[0].finish_reason

        try:
            return await asyncio.gather(*(one(n, t) for n in SCHEMAS for t in (0.0, 1.0)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 2 * len(SCHEMAS) >= 40
    for name, temperature, schema, content, reason in results:
        assert reason == "stop", (name, temperature, content)
        jsonschema.validate(json.loads(content), schema)


def test_streamed_json_with_n2_reassembles_and_validates(client):
    schema = bounded_numbers(SCHEMAS["nested_object"])
    stream = client.chat.completions.create(
        model=live_server.MODEL, messages=_chat(), max_tokens=200, temperature=1.0, n=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    parts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "stop", 1: "stop"}
    for text in parts.values():
        jsonschema.validate(json.loads(text), schema)


def test_vllm_fields_through_extra_body(client):
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ({"guided_regex": "(yes|no)!"}, r"(yes|no)!"),
        ({"guided_choice": ["red", "green"]}, r"red|green"),
        ({"guided_grammar": 'start: "a" "b"*'}, r"ab*"),
    ]
    for extra, pattern in cases:
        r = client.completions.create(model=live_server.MODEL, prompt="x", max_tokens=30, temperature=1.0,
                                      extra_body=extra)
        assert re.fullmatch(pattern, r.choices[0].text), (extra, r.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), max_tokens=30,
                                       extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_bad_or_conflicting_specs_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=live_server.MODEL, prompt="x", extra_body={"guided_regex": "(a"})
    assert "unclosed group" in e.value.message and e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live_server.MODEL, messages=_chat(), response_format={"type": "json_object"},
                                       extra_body={"guided_choice": ["a"]})
    assert "both constrain the output" in e.value.message


# ---- tools ------------------------------------------------------------------------------------
def _stream_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = c.finish_reason or reason
    return calls, reason, content


def test_required_tool_choice_streams_valid_calls(client):
    stream = client.chat.completions.create(model=live_server.MODEL, messages=_chat("weather?"), tools=[WEATHER, TIME],
                                            tool_choice="required", max_tokens=200, temperature=1.0, seed=1,
                                            stream=True)
    calls, reason, content = _stream_calls(stream)
    assert reason == "tool_calls" and calls and content == ""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_named_tool_choice_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), tools=[WEATHER, TIME],
                                       tool_choice=choice, max_tokens=100, temperature=0.0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"  # OpenAI's reason when named
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed, _, _ = _stream_calls(client.chat.completions.create(
        model=live_server.MODEL, messages=_chat(), tools=[WEATHER, TIME], tool_choice=choice, max_tokens=100,
        temperature=0.0, stream=True))
    assert streamed[0]["arguments"] == call.function.arguments  # greedy: same call both ways


def test_auto_tool_choice_parses_the_models_markup(client):
    # The grammar makes the model write Hermes markup; the guessed parser must turn it into a call.
    extra = {"structured_outputs": {"regex": "Let me check\\. " + HERMES_CALL}}
    r = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), tools=[WEATHER], max_tokens=120,
                                       temperature=1.0, seed=4, extra_body=extra)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and re.fullmatch("[a-z]{3,8}", args["city"])
    calls, reason, content = _stream_calls(client.chat.completions.create(
        model=live_server.MODEL, messages=_chat(), tools=[WEATHER], max_tokens=120, temperature=1.0, seed=4,
        stream=True, extra_body=extra))
    assert reason == "tool_calls" and content == "Let me check."
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == args


def test_parallel_tool_calls_false_keeps_one_call(client):
    extra = {"structured_outputs": {"regex": f"{HERMES_CALL}\\n{HERMES_CALL}"}}
    both = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), tools=[WEATHER], max_tokens=160,
                                          temperature=0.0, extra_body=extra)
    one = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), tools=[WEATHER], max_tokens=160,
                                         temperature=0.0, parallel_tool_calls=False, extra_body=extra)
    assert len(both.choices[0].message.tool_calls) == 2
    assert [c.function.arguments for c in one.choices[0].message.tool_calls] == [
        both.choices[0].message.tool_calls[0].function.arguments]


def test_tool_history_reaches_the_template(client, server):
    from transformers import AutoTokenizer

    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model=live_server.MODEL, messages=history, tools=[WEATHER], max_tokens=1)
    tok = AutoTokenizer.from_pretrained(Path(server.log).parent / "tiny-llama")
    as_template_sees_it = [history[0], {**history[1], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        history[2]]
    want = tok.apply_chat_template(as_template_sees_it, tools=[WEATHER], chat_template=TEMPLATE,
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(want)
    rendered = tok.decode(want)
    assert '"arguments": {"city": "Paris", "days": 1}' in rendered and "[call_1]" in rendered


def test_tool_choice_none_and_an_unknown_name(server):
    import httpx2

    body = {"messages": _chat(), "tools": [WEATHER], "tool_choice": "auto"}
    ok = httpx2.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"] is None
    r = httpx2.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": {"type": "function",
                                                                                      "function": {"name": "nope"}}})
    assert r.status_code == 400 and "'nope', which is not in tools" in r.json()["error"]["message"]


# ---- reasoning --------------------------------------------------------------------------------
def test_reasoning_content_whole_and_streamed(client):
    extra = {"structured_outputs": {"regex": "<think>[a-z]{4,8}</think>[a-z]{2,6}"}}
    r = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), max_tokens=80, temperature=1.0,
                                       seed=2, extra_body=extra)
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{4,8}", reasoning) and re.fullmatch("[a-z]{2,6}", msg.content)
    stream = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), max_tokens=80, temperature=1.0,
                                            seed=2, stream=True, extra_body=extra)
    got = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        for c in chunk.choices:
            got["content"] += c.delta.content or ""
            got["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert got == {"reasoning_content": reasoning, "content": msg.content}


def test_chat_template_kwargs_reach_the_template(client):
    base = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), max_tokens=1)
    off = client.chat.completions.create(model=live_server.MODEL, messages=_chat(), max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the template adds "<think></think>" after the generation prompt when thinking is off
    assert off.usage.prompt_tokens > base.usage.prompt_tokens


# ---- langchain --------------------------------------------------------------------------------
def test_langchain_structured_output_and_bind_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=live_server.MODEL, max_tokens=120,
                        temperature=0.0, max_retries=0)
    person = llm.with_structured_output(Person).invoke("Describe someone.")
    assert isinstance(person, Person)

    class WeatherArgs(BaseModel):  # bounded: a random model does not end an unbounded string
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, days: int) -> str:
        """Weather in a city for some days."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?")
    assert len(msg.tool_calls) == 1, (msg, msg.invalid_tool_calls)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
