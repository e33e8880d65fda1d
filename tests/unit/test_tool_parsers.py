"""Tool-call parsers on real-looking model outputs: the full-text result against hand-written
expectations, and the streamed deltas (the text split at every character boundary, one
character at a time, and in 3-character chunks) reassembling to the same result with OpenAI's
delta order (id and name first, then argument fragments). Plus the schema that a forced
``tool_choice`` hands to the grammar, driven through the grammar and parsed back."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    forced_tool_parser,
    get_tool_parser,
    guess_tool_parser,
    tool_choice_schema,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"query": "SELECT \\"}\\" FROM t WHERE x = \'{\'", "opts": {"limit": [1, 2], "s": "a]b"}}'

# (parser class, output, expected content, expected [(name, arguments)])
CASES = [
    (HermesToolParser, f'I\'ll check the weather for you.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "I'll check the weather for you.", [("get_weather", WEATHER)]),
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Zurich"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Zürich"}'), ("get_time", '{"tz": "Europe/Zurich"}')]),
    (HermesToolParser, "The capital of France is Paris.", "The capital of France is Paris.", []),
    (HermesToolParser, '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    (HermesToolParser, "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
    (HermesToolParser, f'<tool_call>{{"name": "run_sql", "arguments": {TRICKY}}}</tool_call>', None, [("run_sql", TRICKY)]),
    (HermesToolParser, '<tool_call>\n{"arguments": {"a": 1}, "name": "late_name"}\n</tool_call>', None, [("late_name", '{"a": 1}')]),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", '{"a": 1}')]),
    (HermesToolParser, '<tool_call>\n{"name": "ping"}\n</tool_call>\nDone, a < b.', "Done, a < b.", [("ping", "{}")]),
    (HermesToolParser, "Use <tool instead <tool_cal", "Use <tool instead <tool_cal", []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": ' + WEATHER + "}", None, [("get_weather", WEATHER)]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    (Llama3JsonToolParser, "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    (Llama3JsonToolParser, '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),
    (Llama3JsonToolParser, '\n\n {"name": "f", "parameters": {"q": "x"}}', None, [("f", '{"q": "x"}')]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {}} and then some text', "and then some text", [("f", "{}")]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"a": 1', None, [("f", '{"a": 1')]),  # cut by max_tokens
    (Llama3JsonToolParser, '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    (Llama3JsonToolParser, f'{{"name": "run_sql", "parameters": {TRICKY}}}', None, [("run_sql", TRICKY)]),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]", None, [("get_weather", WEATHER)]),
    (MistralToolParser, 'Let me look.[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
     "Let me look.", [("a", '{"x": 1}'), ("b", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    (MistralToolParser, '[TOOL_CALLS]a[ARGS]{"x": [1, {"y": "]"}]}[TOOL_CALLS]b[ARGS]{}', None,
     [("a", '{"x": [1, {"y": "]"}]}'), ("b", "{}")]),
    (MistralToolParser, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', None,
     [("get_weather", '{"city": "Paris"}')]),
    (MistralToolParser, "Bonjour ! [TOOL_CALL is not a tag", "Bonjour ! [TOOL_CALL is not a tag", []),
    (MistralToolParser, "[TOOL_CALLS]oops no args", "[TOOL_CALLS]oops no args", []),
]
IDS = [f"{c[0].name}-{i}" for i, c in enumerate(CASES)]


def counter_ids():
    n = itertools.count()
    return lambda: f"call{next(n)}"


def reassemble(pieces):
    """Join streamed pieces, checking OpenAI's delta shape on the way."""
    content, calls = "", {}
    for p in pieces:
        assert (p.content is None) != (p.tool_calls is None), p
        content += p.content or ""
        for d in p.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.type is None and d.function.name is None, d
                calls[d.index][2] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def stream(cls, pieces):
    parser = cls(counter_ids())
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    return reassemble(out + parser.finish())


def expected(calls):
    return [(f"call{i}", name, args) for i, (name, args) in enumerate(calls)]


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=IDS)
def test_full_text(cls, text, content, calls):
    got_content, got_calls = cls(counter_ids()).extract(text)
    assert got_content == content
    assert [(c.id, c.function.name, c.function.arguments) for c in got_calls] == expected(calls)
    assert all(c.type == "function" for c in got_calls)


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=IDS)
def test_stream_split_anywhere(cls, text, content, calls):
    want = (content, expected(calls))
    for i in range(len(text) + 1):
        assert stream(cls, [text[:i], text[i:]]) == want, f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    assert stream(cls, list(text)) == want
    assert stream(cls, [text[i : i + 3] for i in range(0, len(text), 3)]) == want


def test_name_streams_before_the_arguments_finish():
    parser = HermesToolParser(counter_ids())
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    (piece,) = first
    head, args = piece.tool_calls
    assert (head.index, head.id, head.function.name) == (0, "call0", "get_weather")
    assert args.function.arguments == '{"city": "Pa'
    (more,) = parser.feed('ris"}}\n</tool_call>')
    assert more.tool_calls[0].function.arguments == 'ris"}'
    assert parser.finish() == []


def test_content_is_not_held_back_without_a_possible_tag():
    parser = HermesToolParser()
    assert [p.content for p in parser.feed("Hello there")] == ["Hello there"]
    assert parser.feed(" <tool") == []  # could be a tag
    assert [p.content for p in parser.feed("tip>")] == [" <tooltip>"]


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = MistralToolParser().extract('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}')
    assert len({c.id for c in calls}) == 2
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, calls = HermesToolParser().extract('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_a_parser_serves_one_sequence():
    parser = HermesToolParser()
    parser.feed("x")
    with pytest.raises(RuntimeError, match="needs a fresh parser"):
        parser.extract("y")
    parser.finish()
    with pytest.raises(RuntimeError, match="one parser per sequence"):
        parser.feed("z")


def test_registry_and_unknown_name():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert get_tool_parser("mistral") is MistralToolParser
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'qwen'.*hermes.*llama3_json.*mistral"):
        get_tool_parser("qwen")


QWEN_TEMPLATE = (
    '{%- if tools %}{{- "# Tools\\n\\nYou may call one or more functions" }}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}{%- endif %}'
)
LLAMA32_TEMPLATE = (
    '{{- "Given the following functions, please respond with a JSON for a function call with its proper '
    'arguments that best answers the given prompt.\\n\\n" }}{{- \'Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.\' }}{%- if message.role == "ipython" %}'
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
)
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool in message.tool_calls %}"


def test_guess_from_chat_template():
    from core.gguf_file import load_gguf_tokenizer
    from core.model_loader import default_model_path

    assert guess_tool_parser(QWEN_TEMPLATE) == "hermes"
    assert guess_tool_parser(LLAMA32_TEMPLATE) == "llama3_json"
    assert guess_tool_parser(MISTRAL_TEMPLATE) == "mistral"
    assert guess_tool_parser(None) is None
    smollm2 = load_gguf_tokenizer(default_model_path(), None)
    assert guess_tool_parser(smollm2.chat_template) is None  # SmolLM2's template has no tool format


# ---- forced tool_choice ----------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
                    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_tool_choice_schema_shapes():
    assert tool_choice_schema(TOOLS, "auto") is None
    assert tool_choice_schema(TOOLS, "none") is None
    assert tool_choice_schema(None, None) is None
    named = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named == TOOLS[0]["function"]["parameters"]
    assert tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "get_time"}}) == {
        "type": "object", "properties": {}}
    required = tool_choice_schema(TOOLS, "required")
    jsonschema.validate([{"name": "get_time", "parameters": {}},
                         {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}], required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


@pytest.mark.parametrize(
    "tools,choice,pattern",
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, r"'nope', which is not in tools.*get_time.*get_weather"),
        (None, "required", r"'required' needs at least one entry in tools"),
        ([{"type": "function"}], "auto", r"tools\[0\] must be"),
        (TOOLS, "always", r"tool_choice 'always' must be"),
        (TOOLS, {"function": "get_time"}, r"must be 'auto', 'none', 'required' or"),
    ],
)
def test_tool_choice_errors(tools, choice, pattern):
    with pytest.raises(ValueError, match=pattern):
        tool_choice_schema(tools, choice)


def _generate(schema, seed):
    """Random walk under the grammar for ``schema`` on the tiny tokenizer; returns text."""
    from core.structured_output import (
        GrammarCompiler,
        GrammarMatcher,
        GrammarSpec,
        allocate_bitmask,
        apply_bitmask,
    )
    from tests.helpers import build_tokenizer

    tok = build_tokenizer(512)
    compiler = GrammarCompiler(tok, vocab_size=512)
    m = GrammarMatcher(compiler.compile(GrammarSpec.of("json_schema", schema)))
    bitmask, gen, ids = allocate_bitmask(1, 512), torch.Generator().manual_seed(seed), []
    while not m.is_terminated and len(ids) < 400:
        m.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, 512, generator=gen)
        apply_bitmask(logits, bitmask)
        ids.append(int(logits.argmax()))
        assert m.accept(ids[-1])
    assert m.is_terminated
    return tok.decode([t for t in ids if t != tok.eos_token_id])


@pytest.mark.parametrize("seed", range(3))
def test_forced_outputs_parse_into_valid_calls(seed):
    params = {f["function"]["name"]: f["function"].get("parameters") or {"type": "object"} for f in TOOLS}
    text = _generate(tool_choice_schema(TOOLS, "required"), seed)
    content, calls = forced_tool_parser("required", counter_ids()).extract(text)
    assert content is None and calls, text
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert stream(lambda ids: forced_tool_parser("required", ids), list(text)) == (
        None, [(c.id, c.function.name, c.function.arguments) for c in calls])

    choice = {"type": "function", "function": {"name": "get_weather"}}
    text = _generate(tool_choice_schema(TOOLS, choice), seed)
    content, (call,) = forced_tool_parser(choice, counter_ids()).extract(text)
    assert content is None and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params["get_weather"])
    assert stream(lambda ids: forced_tool_parser(choice, ids), list(text)) == (
        None, [("call0", "get_weather", call.function.arguments)])


def test_forced_choice_none_for_auto():
    assert forced_tool_parser("auto") is None
    assert forced_tool_parser(None) is None


# ---- property: any arguments, any split ------------------------------------------------------------


_TAGS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>")
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12).filter(
    lambda s: not any(t in s for t in _TAGS)
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_args = st.dictionaries(_text, _json, max_size=4)
_names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)


def _render(fmt: str, content: str, calls: list[tuple[str, str]]) -> str:
    if fmt == "hermes":
        blocks = "".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>\n' for n, a in calls)
        return content + "\n" + blocks
    if fmt == "llama3_json":
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)
    if fmt == "mistral_v11":
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)
    items = ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls)
    return content + f"[TOOL_CALLS][{items}]"


_PARSER = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
           "mistral_v11": MistralToolParser, "mistral_v3": MistralToolParser}


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(sorted(_PARSER)),
    content=_text,
    calls=st.lists(st.tuples(_names, _args), min_size=1, max_size=3),
    ensure_ascii=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_any_arguments_any_split(fmt, content, calls, ensure_ascii, cuts):
    calls = [(n, json.dumps(a, ensure_ascii=ensure_ascii)) for n, a in calls]
    if fmt == "llama3_json":
        content = ""  # a Llama output is either calls or content
    text = _render(fmt, content, calls)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    want = (content.strip() or None, expected(calls))
    assert stream(_PARSER[fmt], pieces) == want
    got_content, got_calls = _PARSER[fmt](counter_ids()).extract(text)
    assert (got_content, [(c.id, c.function.name, c.function.arguments) for c in got_calls]) == want
    for (_, args), call in zip(calls, got_calls):
        assert json.loads(call.function.arguments) == json.loads(args)


# ---- a chat choice's message: reasoning, then tool calls (core/entrypoints/openai/chat_output.py)
def _stream_shape(shape, pieces):
    streamer = shape.streamer()
    deltas = [d for d in [*(streamer.feed(p) for p in pieces), streamer.finish()] if d is not None]
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.tool_calls or ():
            call = calls.setdefault(c.index, {"name": "", "arguments": ""})
            call["name"] += c.function.name or ""
            call["arguments"] += c.function.arguments or ""
    return reasoning or None, content or None, calls, streamer.has_calls


SHAPED = ('<think>why not</think>Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
          '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("cut", range(0, len(SHAPED) + 1, 7))
def test_choice_shape_streamed_equals_whole(cut):
    from core.entrypoints.openai.chat_output import ChoiceShape

    shape = ChoiceShape(reasoning_parser="qwen3", tool_parser="hermes")
    whole = shape.message(SHAPED)
    assert whole.reasoning_content == "why not" and whole.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [("f", '{"x": 1}'), ("g", "{}")]
    reasoning, content, calls, has_calls = _stream_shape(shape, [SHAPED[:cut], SHAPED[cut:]])
    assert (reasoning, content) == (whole.reasoning_content, whole.content) and has_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_choice_shape_single_call_and_finish_reasons():
    from core.entrypoints.openai.chat_output import ChoiceShape

    one = ChoiceShape(tool_parser="hermes", parallel_tool_calls=False)
    assert [c.function.name for c in one.message(SHAPED.split("</think>")[1]).tool_calls] == ["f"]
    _, _, calls, _ = _stream_shape(one, list(SHAPED.split("</think>")[1]))
    assert list(calls) == [0]
    assert one.finish_reason("stop", True) == "tool_calls" and one.finish_reason("length", True) == "length"
    assert one.finish_reason("stop", False) == "stop"
    named = ChoiceShape(tool_choice={"type": "function", "function": {"name": "f"}})
    msg = named.message('{"x": 2}')
    assert msg.content is None and msg.tool_calls[0].function.arguments == '{"x": 2}'
    assert named.finish_reason("stop", True) == "stop"  # OpenAI's reason for a named function
    plain = ChoiceShape()
    assert plain.message("<tool_call>x</tool_call>").content == "<tool_call>x</tool_call>"  # no parser: text


def test_auto_without_a_parser_or_known_template_is_a_400_naming_the_flag():
    from types import SimpleNamespace

    from core.entrypoints.openai.chat import _tool_mode
    from core.entrypoints.openai.errors import OpenAIError
    from core.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                tools=[{"type": "function", "function": {"name": "f"}}])
    ctx = SimpleNamespace(tool_call_parser=None, chat_template="{{ messages }}",
                          engine=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None)))
    with pytest.raises(OpenAIError, match="--tool-call-parser") as e:
        _tool_mode(ctx, req)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    ctx.tool_call_parser = "mistral"
    assert _tool_mode(ctx, req) == ("mistral", None)
    ctx.tool_call_parser, ctx.chat_template = None, "... <tool_call> ..."
    assert _tool_mode(ctx, req) == ("hermes", None)
    forced = req.model_copy(update={"tool_choice": "required"})
    assert _tool_mode(ctx, forced) == (None, "required")


def test_ignored_fields_header_value_is_safe_and_bounded():
    from core.entrypoints.openai.serving import ignored_fields_value

    assert ignored_fields_value(["a", "b_c"]) == "a, b_c"
    assert ignored_fields_value(["x\r\ny", "é,z"]) == "x??y, ??z"
    long = ignored_fields_value([f"f{i}" for i in range(1000)])
    assert len(long) <= 1024 and long.endswith(", ...")
