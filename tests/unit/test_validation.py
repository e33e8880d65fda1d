"""One validation policy, checked without a server: strict request shapes and the errors they
produce (field, value, limit), engine arguments, server arguments, the Host check, and the
shutdown grace that ends open streams.

The offline ``LLM`` cases run a tiny random Llama on CPU (issue 16 item 7).
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.engine_args import EngineArgs
from core.entrypoints.openai.args import ServerArgs
from core.entrypoints.openai.errors import install_error_handlers
from core.entrypoints.openai.middleware import (
    HostCheckMiddleware,
    _host_name,
    default_allowed_hosts,
)
from core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from core.entrypoints.openai.shutdown import ShutdownGrace
from core.sampling_params import SamplingParams


# ---- request bodies: strict shapes, errors that name the field ---------------------------------
@pytest.fixture(scope="module")
def api() -> TestClient:
    """The error handlers and request models of the real server on two echo routes."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/c")
    async def completions(body: CompletionRequest) -> dict:
        return {"ok": True}

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"ok": True}

    return TestClient(app)


def _error(resp) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize(("body", "param", "shown"), [
    ({"prompt": [True]}, "prompt", "True"),
    ({"prompt": [1, 2.5]}, "prompt", "2.5"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens", "'10'"),
    ({"prompt": "hi", "max_tokens": 10.0}, "max_tokens", "10.0"),
    ({"prompt": "hi", "stream": "yes"}, "stream", "'yes'"),
    ({"prompt": "hi", "n": True}, "n", "True"),
    ({"prompt": "hi", "max_tokens": 2**64}, "max_tokens", str(2**64)),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    ({"prompt": "hi", "stop_token_ids": [False]}, "stop_token_ids", "False"),
    ({"prompt": ""}, "prompt", "''"),
    ({"prompt": ["ok", ""]}, "prompt", "''"),
])
def test_lax_values_are_refused_naming_the_field(api, body, param, shown):
    err = _error(api.post("/c", json=body))
    assert err["param"] == param
    assert shown in err["message"], err["message"]
    # union member tags are pydantic's, not the client's: never in the path
    assert "list[" not in err["message"] and ".str" not in err["message"]


def test_lone_surrogate_is_a_clean_400(api):
    raw = b'{"prompt": "ab\\ud800cd"}'
    err = _error(api.post("/c", content=raw, headers={"content-type": "application/json"}))
    assert err["param"] == "prompt"
    assert "surrogate" in err["message"] and "character 2" in err["message"]
    raw = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    err = _error(api.post("/chat", content=raw, headers={"content-type": "application/json"}))
    assert err["param"] == "messages" and "surrogate" in err["message"]
    # a properly paired surrogate is just a character
    ok = api.post("/c", content=b'{"prompt": "\\ud83d\\ude00"}', headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_malformed_json_says_so_without_an_offset_as_param(api):
    err = _error(api.post("/c", content=b'{"prompt": "x",, }', headers={"content-type": "application/json"}))
    assert err["param"] is None and err["code"] == "invalid_json"
    assert "not valid JSON" in err["message"]


def test_missing_nested_field_names_its_path(api):
    err = _error(api.post("/chat", json={"messages": [{"content": "hi"}]}))
    assert err["param"] == "messages" and "messages[0].role" in err["message"]
    err = _error(api.post("/chat", json={}))
    assert err["param"] == "messages"


def test_long_values_are_clipped_in_messages(api):
    err = _error(api.post("/c", json={"prompt": "x", "max_tokens": "9" * 100_000}))
    assert len(err["message"]) < 400


def test_valid_shapes_still_pass(api):
    for body in ({"prompt": "hi", "temperature": 1}, {"prompt": [1, 2, 3]}, {"prompt": [[1], [2, 3]]},
                 {"prompt": ["a", "b"], "logit_bias": {"17": -100}, "stop": "x"}):
        assert api.post("/c", json=body).status_code == 200, body


def test_openapi_schema_agrees_with_the_validation():
    props = CompletionRequest.model_json_schema()["properties"]
    prompt_strings = [m for m in props["prompt"]["anyOf"] if m.get("type") == "string"]
    assert prompt_strings and all(m.get("minLength") == 1 for m in prompt_strings)
    bias = next(m for m in props["logit_bias"]["anyOf"] if m.get("type") == "object")
    assert bias["propertyNames"] == {"pattern": "^[0-9]{1,19}$"}
    assert "patternProperties" not in bias and bias["additionalProperties"]["maximum"] == 100


# ---- SamplingParams ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(stop_token_ids=(1.0,)), dict(stop_token_ids=(True,)), dict(max_tokens=2.0),
                                    dict(n=True), dict(logit_bias={1.5: 1.0}), dict(seed=2**63)])
def test_sampling_params_refuse_non_integers(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


# ---- engine and server arguments --------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "limit"), [
    (dict(max_model_len=-1), ">= 1"), (dict(max_model_len=0), ">= 1"), (dict(block_size=0), ">= 1"),
    (dict(max_num_batched_tokens=0), ">= 1"), (dict(max_num_seqs=0), ">= 1"), (dict(max_model_len=1.5), "integer"),
    (dict(max_num_seqs=True), "integer"), (dict(tensor_parallel_size=0), ">= 1"),
    (dict(gpu_memory_utilization=0), "(0, 1]"), (dict(gpu_memory_utilization=1.5), "(0, 1]"),
    (dict(swap_space=-1), ">= 0"), (dict(kv_cache_memory="0"), "> 0"), (dict(dtype="fp8"), "float32"),
    (dict(scheduling_policy="lifo"), "fcfs"),
])
def test_engine_args_refuse_zero_negative_and_wrong_types(kwargs, limit):
    name = next(iter(kwargs))
    with pytest.raises(ValueError) as e:
        EngineArgs(**kwargs)
    assert name in str(e.value) and repr(kwargs[name]) in str(e.value) and limit in str(e.value)


def test_engine_args_defaults_and_none_are_fine():
    EngineArgs()
    EngineArgs(max_model_len=None, block_size=None, max_num_batched_tokens=None, kv_cache_memory="2GiB")


@pytest.mark.parametrize("kwargs", [dict(max_request_body_bytes=0), dict(timeout_header=0), dict(timeout_body=-1),
                                    dict(max_prompt_chars=0), dict(shutdown_grace_period=-1), dict(allowed_hosts=("",))])
def test_server_args_refuse_bad_limits(kwargs):
    flag = "--" + next(iter(kwargs)).replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kwargs)


# ---- Host header check ------------------------------------------------------------------------
def test_default_allowed_hosts():
    assert default_allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "[::1]")
    assert "127.0.0.2" in default_allowed_hosts("127.0.0.2")
    assert "[::1]" in default_allowed_hosts("::1")
    assert default_allowed_hosts("localhost") == ("localhost", "127.0.0.1", "[::1]")
    assert default_allowed_hosts("0.0.0.0") == ("*",)
    assert default_allowed_hosts("10.1.2.3") == ("*",)
    assert default_allowed_hosts("myhost.internal") == ("*",)


def test_host_names_and_matching():
    assert _host_name(b"LocalHost:8000") == "localhost"
    assert _host_name(b"[::1]:8000") == "[::1]"
    assert _host_name(b"example.com") == "example.com"
    check = HostCheckMiddleware(None, ["localhost", "*.example.com"])
    assert check.allows("localhost") and check.allows("api.example.com")
    assert not check.allows("example.com.evil.net") and not check.allows("evil.com")
    assert HostCheckMiddleware(None, ["*"]).allows("anything")


# ---- shutdown grace ---------------------------------------------------------------------------
async def _read_until_the_grace_ends(items, closed: asyncio.Event) -> list:
    """Read ``items`` under a 50 ms grace that starts now; it must end with the grace's
    error, with ``items`` closed and no request left open. Returns what was read."""
    grace = ShutdownGrace(0.05)
    got = []
    grace.begin(asyncio.get_running_loop())
    with pytest.raises(Exception) as e:
        async for item in grace.until_expired(items):
            got.append(item)
            assert grace.open == 1
    assert e.value.status == 503 and e.value.code == "server_shutting_down"
    assert closed.is_set() and grace.open == 0
    return got


def test_grace_ends_an_open_stream_with_its_error():
    async def scenario():
        closed = asyncio.Event()

        async def forever():
            try:
                while True:
                    yield "token"
                    await asyncio.sleep(0.01)
            finally:
                closed.set()

        assert await _read_until_the_grace_ends(forever(), closed)

    asyncio.run(scenario())


def test_grace_ends_a_stream_waiting_for_its_next_item():
    """No item ever comes (a stalled request): the expiry itself ends the wait."""
    async def scenario():
        closed = asyncio.Event()

        async def stalled():
            try:
                yield "first"
                await asyncio.Event().wait()  # never set
            finally:
                closed.set()

        assert await _read_until_the_grace_ends(stalled(), closed) == ["first"]
        # the cancel that woke it was taken back: the task can go on awaiting
        await asyncio.sleep(0)
        assert asyncio.current_task().cancelling() == 0

    asyncio.run(scenario())


def test_grace_ends_a_reader_busy_elsewhere_at_its_next_item():
    async def scenario():
        grace = ShutdownGrace(0.02)
        got = []
        grace.begin(asyncio.get_running_loop())
        with pytest.raises(Exception) as e:
            async for item in grace.until_expired(_counting()):
                got.append(item)
                await grace.expired.wait()  # the grace runs out while the reader is busy (writing)
        assert e.value.status == 503 and got == [0]

    asyncio.run(scenario())


async def _counting():
    i = 0
    while True:
        yield i
        i += 1


def test_a_cancel_that_is_not_the_grace_stays_a_cancel():
    async def scenario():
        grace = ShutdownGrace(30)

        async def read():
            async for _ in grace.until_expired(_stalled_forever()):
                pass

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert grace.open == 0

    asyncio.run(scenario())


async def _stalled_forever():
    await asyncio.Event().wait()
    yield None


def test_grace_passes_a_finished_stream_through():
    async def scenario():
        grace = ShutdownGrace(30)

        async def three():
            for i in range(3):
                yield i

        return [i async for i in grace.until_expired(three())]

    assert asyncio.run(scenario()) == [0, 1, 2]


# ---- the offline LLM --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from core.entrypoints.llm import LLM
    from tests.helpers import tiny_llama_dir

    path = tiny_llama_dir(tmp_path_factory.mktemp("validation"))
    return LLM(str(path), platform="cpu", dtype="float32", max_model_len=64, kv_cache_memory="4MiB")


@pytest.mark.parametrize(("prompts", "error", "words"), [
    (None, TypeError, "prompts"), (123, TypeError, "prompts"), ({"prompt": "hi"}, TypeError, "dict"),
    ([], ValueError, "empty"), ([[1, 2.0, 3]], ValueError, "2.0"), ([[1, True]], ValueError, "True"),
    ([1, True], ValueError, "True"), (["ok", 5], TypeError, "prompts[1]"), ([[]], ValueError, "empty"),
])
def test_generate_refuses_bad_prompts(llm, prompts, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_generate_refuses_a_dict_as_sampling_params(llm):
    with pytest.raises(TypeError, match="sampling_params.*SamplingParams"):
        llm.generate("hi", {"max_tokens": 3}, use_tqdm=False)


def test_failed_generate_leaves_nothing_queued(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    too_long = list(range(3, 3 + 100))  # > max_model_len 64: refused by the engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["first", "second", too_long], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    outs = llm.generate(["third"], greedy, use_tqdm=False)
    assert [o.prompt for o in outs] == ["third"]


def test_llm_refuses_a_negative_max_model_len():
    from core.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=r"max_model_len.*-1.*>= 1"):
        LLM(max_model_len=-1)
