"""Structured output and forced tool calls on the embedded SmolLM2-135M-Instruct (a real model,
its own chat template, a 49,152-token vocabulary) through ``core serve`` and the ``openai``
SDK: ``beta.chat.completions.parse`` with a pydantic model, and ``tool_choice: required``
streamed; every answer validated with ``jsonschema``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from core.model_loader import default_model_path
from tests.helpers import wait_for_server
from tests.integration import live_server

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float = Field(ge=0, le=40)
    continent: Literal["Europe", "Asia", "Africa", "Americas", "Oceania"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("smollm2") / "server.log"
    srv = live_server.start(Path(default_model_path()), log, "--kv-cache-memory", "256MiB", max_model_len=1024)
    try:
        wait_for_server(srv.proc, srv.url, srv.log)
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        live_server.stop(srv)


def test_parse_a_pydantic_model(client):
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    for temperature in (0.0, 1.0):
        done = client.beta.chat.completions.parse(model=live_server.MODEL, messages=messages, response_format=City,
                                                  max_tokens=120, temperature=temperature, seed=1)
        assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
        assert isinstance(done.choices[0].message.parsed, City)
        jsonschema.validate(json.loads(done.choices[0].message.content), City.model_json_schema())


def test_required_tool_call_streamed(client):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": params}}]
    stream = client.chat.completions.create(
        model=live_server.MODEL, messages=[{"role": "user", "content": "What is the weather in Rome?"}], tools=tools,
        tool_choice="required", max_tokens=120, temperature=0.0, stream=True)
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, ["", ""])
                call[0] += d.function.name or ""
                call[1] += d.function.arguments or ""
            reason = c.finish_reason or reason
    assert reason == "tool_calls" and calls
    for name, arguments in calls.values():
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), params)
