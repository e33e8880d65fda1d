"""Structured output: grammar compile and cache, per-sequence matchers, bitmask application.

The schema suite (tests/unit/structured_schemas.py, 23 schemas) is driven token by token on
the tiny test tokenizer and on the embedded SmolLM2 tokenizer: each step the matcher fills its
mask, random logits are masked with :func:`apply_bitmask`, and the next token is the argmax
("temperature 0") or a sample ("temperature 1"). The decoded text must parse as JSON and
validate against its schema with ``jsonschema``, an implementation independent of the grammar
library. The bitmask functions are checked against a per-token Python reference on random
masks and logits.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from core.structured_output import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_compiled,
    apply_bitmask_host,
    apply_bitmask_numpy,
    close_objects,
    fill_bitmasks,
    unpack_bitmask,
)
from core.structured_output.request import spec_from_request
from tests.helpers import build_tokenizer
from tests.unit.structured_schemas import SCHEMAS

MAX_STEPS = 400  # every schema in the suite is bounded well below this


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer(512)
    # the model's vocabulary is wider than the tokenizer's (padding rows in the LM head)
    return tok, GrammarCompiler(tok, vocab_size=520)


@pytest.fixture(scope="module")
def smollm2():
    from core.gguf_file import load_gguf_tokenizer
    from core.model_loader import default_model_path

    tok = load_gguf_tokenizer(default_model_path(), None)
    return tok, GrammarCompiler(tok, vocab_size=len(tok))


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _decode(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != tok.eos_token_id])


def drive(compiler, tok, spec, temperature, seed, n=1):
    """Generate ``n`` independent outputs under ``spec``; returns their texts."""
    compiled = compiler.compile(spec)
    matchers = [GrammarMatcher(compiled) for _ in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    bitmask = allocate_bitmask(n, compiler.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(MAX_STEPS):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated]
        if not live:
            break
        fill_bitmasks(compiler, [matchers[i] for i in live], list(range(len(live))), bitmask)
        logits = torch.randn(n, compiler.vocab_size, generator=gen)
        apply_bitmask(logits, bitmask[: len(live)], rows=live)
        for i in live:
            token = _pick(logits[i], temperature, gen)
            assert matchers[i].accept(token), (spec.kind, matchers[i].error)
            outputs[i].append(token)
    assert all(m.is_terminated for m in matchers), f"not terminated after {MAX_STEPS} steps"
    return [_decode(tok, ids) for ids in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_schema_suite_validates(which, name, temperature, request):
    tok, compiler = request.getfixturevalue(which)
    schema = SCHEMAS[name]
    for seed in range(2 if which == "tiny" else 1):  # the 49k-token walks cost more
        (text,) = drive(compiler, tok, GrammarSpec.of("json_schema", schema), temperature, seed)
        jsonschema.validate(json.loads(text), schema)


def test_n_greater_than_one_gives_independent_valid_outputs(smollm2):
    tok, compiler = smollm2
    schema = SCHEMAS["pydantic_like"]
    texts = drive(compiler, tok, GrammarSpec.of("json_schema", schema), 1.0, seed=3, n=3)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1, texts  # three samples of a large space: not one shared state


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_grammar_kinds(smollm2, temperature):
    tok, compiler = smollm2
    for seed in range(2):
        (date,) = drive(compiler, tok, GrammarSpec.of("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"), temperature, seed)
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", date), date
        (choice,) = drive(compiler, tok, GrammarSpec.of("choice", ["positive", "negative", "neutral"]), temperature, seed)
        assert choice in ("positive", "negative", "neutral")
        lark = 'start: "SELECT " col " FROM " /[a-z]{1,8}/\ncol: "*" | /[a-z]{1,6}/'
        (sql,) = drive(compiler, tok, GrammarSpec.of("grammar", lark), temperature, seed)
        assert re.fullmatch(r"SELECT (\*|[a-z]{1,6}) FROM [a-z]{1,8}", sql), sql
        gbnf = 'root ::= "yes" | "no" | "maybe"'
        (word,) = drive(compiler, tok, GrammarSpec.of("grammar", gbnf), temperature, seed)
        assert word in ("yes", "no", "maybe")


def test_json_object_accepts_objects_and_refuses_other_json(smollm2):
    """Free-form JSON has no length bound, so this follows fixed texts instead of a walk."""
    tok, compiler = smollm2
    compiled = compiler.compile(GrammarSpec.of("json_object"))
    good = GrammarMatcher(compiled)
    for t in tok.encode('{"a": [1, 2, {"b": null}], "c": "d"}', add_special_tokens=False):
        assert good.accept(t), good.error
    assert good.is_accepting and good.is_terminated
    for text in ("[1, 2]", '"str"', "42"):
        m = GrammarMatcher(compiled)
        assert not all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)), text


def test_terminated_matcher_allows_only_eos(tiny):
    tok, compiler = tiny
    m = GrammarMatcher(compiler.compile(GrammarSpec.of("choice", ["ok"])))
    for t in tok.encode("ok", add_special_tokens=False):
        assert m.accept(t)
    assert m.is_terminated
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bitmask, 0)
    assert unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist() == [tok.eos_token_id]


def test_padding_ids_past_the_tokenizer_are_never_allowed(tiny):
    tok, compiler = tiny  # tokenizer 512, model 520
    m = GrammarMatcher(compiler.compile(GrammarSpec.of("json_object")))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, compiler.vocab_size)[0]
    assert allowed[: len(tok)].any() and not allowed[len(tok):].any()


def test_rollback_restores_the_state(smollm2):
    tok, compiler = smollm2
    m = GrammarMatcher(compiler.compile(GrammarSpec.of("json_schema", SCHEMAS["flat_required"])))
    ids = tok.encode('{"name": "Al", "age": 41}', add_special_tokens=False)
    masks = []
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for t in ids:
        m.fill_bitmask(bitmask, 0)
        masks.append(bitmask.clone())
        assert m.accept(t), m.error
    assert m.is_terminated
    m.rollback(3)
    assert not m.is_terminated
    m.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, masks[-3])
    for t in ids[-3:]:
        assert m.accept(t)
    assert m.is_terminated


def test_disallowed_token_is_refused(smollm2):
    tok, compiler = smollm2
    m = GrammarMatcher(compiler.compile(GrammarSpec.of("json_schema", SCHEMAS["string_enum"])))
    ids = tok.encode('{"color": "purple"}', add_special_tokens=False)
    assert not all(m.accept(t) for t in ids)
    assert m.error is not None or not m.is_accepting


# ---- compile: cache, threads, errors -------------------------------------------------------------


def test_cache_returns_the_same_compiled_grammar(tiny):
    _, compiler = tiny
    a = compiler.submit(GrammarSpec.of("json_schema", SCHEMAS["const"]))
    b = compiler.submit(GrammarSpec.of("json_schema", json.dumps(SCHEMAS["const"]), field="other"))
    assert a.result() is b.result()
    non_strict = compiler.compile(GrammarSpec.of("json_schema", SCHEMAS["const"], strict=False))
    assert non_strict is not a.result()


def test_compiles_off_the_calling_thread(tiny):
    _, compiler = tiny
    seen = []
    spec = GrammarSpec.of("regex", "[a-c]{3}x")
    original = compiler._compile

    def spy(s):
        seen.append(threading.current_thread().name)
        return original(s)

    compiler._compile = spy
    try:
        compiler.submit(spec).result()
    finally:
        del compiler._compile
    assert seen and seen[0].startswith("grammar") and seen[0] != threading.current_thread().name


@pytest.mark.parametrize(
    "kind,spec,pattern",
    [
        ("json_schema", {"type": "strin"}, r"response_format\.json_schema.*strin"),
        ("json_schema", {"type": "integer", "minimum": "x"}, r"response_format\.json_schema.*minimum"),
        ("json_schema", {"type": "string", "pattern": "(("}, r"response_format\.json_schema.*unclosed group"),
        ("regex", "a(b", r"structured_outputs\.regex.*unclosed group"),
        ("grammar", 'start: "a" b', r"structured_outputs\.grammar.*\bb\b"),
    ],
)
def test_bad_specs_name_the_field_and_the_library_message(tiny, kind, spec, pattern):
    _, compiler = tiny
    field = "response_format.json_schema" if kind == "json_schema" else f"structured_outputs.{kind}"
    fut = compiler.submit(GrammarSpec.of(kind, spec, field=field))
    with pytest.raises(GrammarError, match="(?s)" + pattern):  # library messages span lines
        fut.result()
    # a failure is not cached (the done-callback that forgets it may run just after result())
    deadline = time.monotonic() + 30
    while compiler.submit(GrammarSpec.of(kind, spec, field=field)) is fut:
        assert time.monotonic() < deadline, "failed compile still cached"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "kind,spec,pattern",
    [
        ("json_schema", "{not json", r"f: the schema is not valid JSON"),
        ("json_schema", [1, 2], r"f: a JSON schema must be an object, got list"),
        ("choice", [], r"f: choice must be a non-empty list of strings"),
        ("choice", ["a", 1], r"f: choice must be a non-empty list of strings"),
        ("regex", "", r"f: regex must be a non-empty string"),
        ("xml", "x", r"f: unknown structured-output kind 'xml'"),
    ],
)
def test_malformed_request_values_are_refused_before_compiling(kind, spec, pattern):
    with pytest.raises(GrammarError, match=pattern):
        GrammarSpec.of(kind, spec, field="f")


def test_vocab_smaller_than_the_tokenizer_is_refused():
    tok = build_tokenizer(300)
    with pytest.raises(ValueError, match=r"vocab_size 290 is smaller than the tokenizer's 300"):
        GrammarCompiler(tok, vocab_size=290)


def test_strict_closes_objects_without_touching_property_maps():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "$defs": {"d": {"type": "object", "properties": {}}},
        "additionalProperties": True,
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is True  # stated: kept
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["$defs"]["d"]  # the input is not modified


def test_strict_schema_refuses_extra_properties(tiny):
    tok, compiler = tiny
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = '{"a": 1, "b": 2}'
    for strict, accepted in ((True, False), (False, True)):
        m = GrammarMatcher(compiler.compile(GrammarSpec.of("json_schema", schema, strict=strict)))
        assert all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) is accepted


# ---- bitmask ---------------------------------------------------------------------------------------


def _reference_mask(logits, bitmask, rows):
    """Per-token Python reference of apply_bitmask."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        words = [w & 0xFFFFFFFF for w in bitmask[i].tolist()]
        for t in range(vocab):
            if t >= 32 * len(words) or not (words[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("apply", [apply_bitmask, apply_bitmask_compiled, apply_bitmask_host, apply_bitmask_numpy])
@pytest.mark.parametrize("vocab,words", [(1003, 32), (64, 2), (100, 3)])
def test_apply_bitmask_matches_reference(apply, vocab, words):
    gen = torch.Generator().manual_seed(vocab)
    batch = 7
    logits = torch.randn(batch, vocab, generator=gen)
    for rows in ([0, 3, 6], [5, 1], list(range(batch)), []):
        bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int32)
        got = logits.clone()
        apply(got, bitmask, rows=rows)
        assert torch.equal(got, _reference_mask(logits, bitmask, rows))
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=gen, dtype=torch.int32)
    got = logits.clone()
    apply(got, bitmask)  # rows=None: row i masks row i
    assert torch.equal(got, _reference_mask(logits, bitmask, list(range(batch))))


@pytest.mark.parametrize("apply", [apply_bitmask, apply_bitmask_compiled, apply_bitmask_host, apply_bitmask_numpy])
def test_apply_bitmask_refuses_mismatched_rows(apply):
    with pytest.raises(ValueError, match=r"bitmask has 2 rows for 3 logits rows"):
        apply(torch.zeros(3, 64), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"bitmask has 2 rows for 1 logits rows"):
        apply(torch.zeros(3, 64), torch.zeros(2, 2, dtype=torch.int32), rows=[0])
    with pytest.raises(ValueError, match=r"bitmask must be a 2-D int32 tensor, got torch.int64"):
        apply(torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64))


def test_fill_bitmask_checks_the_buffer(tiny):
    _, compiler = tiny
    m = GrammarMatcher(compiler.compile(GrammarSpec.of("json_object")))
    with pytest.raises(ValueError, match=r"need \(rows, 17\)"):
        m.fill_bitmask(torch.zeros(1, 16, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"contiguous int32 host tensor"):
        m.fill_bitmask(torch.zeros(1, 17, dtype=torch.int64), 0)
    with pytest.raises(IndexError, match=r"row 1 out of range for 1 rows"):
        m.fill_bitmask(allocate_bitmask(1, compiler.vocab_size), 1)


# ---- request fields -> spec ------------------------------------------------------------------------

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": _SCHEMA}}]


@pytest.mark.parametrize(
    "fields,want",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", "", True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA, "strict": True}}},
         ("json_schema", json.dumps(_SCHEMA), True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA}}},
         ("json_schema", json.dumps(_SCHEMA), False)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+", True)),
        ({"structured_outputs": {"choice": ["a", "b"], "json_object": False}}, ("choice", '["a", "b"]', True)),
        ({"structured_outputs": {"json": json.dumps(_SCHEMA)}}, ("json_schema", json.dumps(_SCHEMA), True)),
        ({"structured_outputs": {"json_object": True}}, ("json_object", "", True)),
        ({"guided_grammar": 'root ::= "x"', "guided_decoding_backend": "auto"}, ("grammar", 'root ::= "x"', True)),
        ({"guided_json": _SCHEMA}, ("json_schema", json.dumps(_SCHEMA), True)),
        ({"tools": _TOOLS, "tool_choice": "auto"}, None),
        # forced calls are strict: the declared arguments only
        ({"tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         ("json_schema", json.dumps(_SCHEMA), True)),
    ],
)
def test_request_fields_map_to_one_spec(fields, want):
    spec = spec_from_request(fields)
    assert (spec if spec is None else (spec.kind, spec.text, spec.strict)) == want


@pytest.mark.parametrize(
    "fields,pattern",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, r"response_format and guided_regex both constrain"),
        ({"structured_outputs": {"regex": "x"}, "tools": _TOOLS, "tool_choice": "required"},
         r"structured_outputs and tool_choice both constrain"),
        ({"structured_outputs": {"regex": "x", "choice": ["a"]}}, r"structured_outputs sets \['choice', 'regex'\]; set exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, r"structured_outputs\.structural_tag is not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, r"response_format\.json_schema\.schema is required"),
        ({"response_format": {"type": "yaml"}}, r"response_format\.type 'yaml' is not one of"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "x"}, r"guided_decoding_backend 'outlines' is not available"),
        ({"guided_whitespace_pattern": " ", "guided_json": _SCHEMA}, r"guided_whitespace_pattern is not supported"),
        ({"tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, r"'g', which is not in tools"),
        ({"guided_choice": []}, r"guided_choice: choice must be a non-empty list"),
    ],
)
def test_request_field_errors_name_the_fields(fields, pattern):
    with pytest.raises(GrammarError, match=pattern):
        spec_from_request(fields)


# ---- the engine core's side: step masks, parking, matchers -------------------------------------
def test_step_bitmask_addresses_the_sampler_rows_by_sequence():
    from core.structured_output.bitmask import StepBitmask

    gen = torch.Generator().manual_seed(4)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    step = StepBitmask(seq_ids=(17, 5), bitmask=mask)
    rows = step.for_rows([5, 9, 17])  # the sampler's row order differs from the mask's
    assert rows.rows == (2, 0)
    logits = torch.randn(3, 90, generator=gen)
    got = logits.clone()
    rows.apply(got)
    want = _reference_mask(logits, mask, [2, 0])
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])  # the unconstrained row is untouched
    with pytest.raises(ValueError, match=r"sequences \[17\]"):
        step.for_rows([5, 9])


class _Scheduler:
    """The two scheduler calls StructuredOutputs makes."""

    def __init__(self):
        self.added = []

    def add_request(self, request):
        self.added.append(request)

    def get_request(self, rid):
        return next((r for r in self.added if r.request_id == rid), None)


def _manager(tok):
    from core.structured_output.engine import StructuredOutputs

    return StructuredOutputs(lambda: tok, len(tok), [tok.eos_token_id])


@pytest.fixture
def tiny_tok():
    return build_tokenizer(512)


def test_requests_park_until_compiled_and_failures_finish_them(tiny_tok):
    tiny = tiny_tok
    from concurrent.futures import Future

    from core.request import Request
    from core.sampling_params import SamplingParams

    so, sched = _manager(tiny), _Scheduler()
    spec = GrammarSpec.of("regex", "[ab]{2,4}")
    gate, compile_now = threading.Event(), so.compiler._compile
    so.compiler._compile = lambda s: gate.wait(60) and compile_now(s)  # hold the compile until told
    parked = Request("r1", (1, 5), SamplingParams(structured=spec))
    so.admit(parked, sched.add_request)
    assert sched.added == [] and so.has_parked()  # a fresh spec: compiling in the pool
    assert so.release_ready(sched.add_request) == [] and sched.added == []
    gate.set()
    so.wait_for_compile(timeout=60)
    assert so.release_ready(sched.add_request) == [] and sched.added == [parked] and not so.has_parked()
    cached = Request("r2", (1, 5), SamplingParams(structured=spec))
    so.admit(cached, sched.add_request)
    assert sched.added == [parked, cached]  # cached: straight to the scheduler
    with pytest.raises(GrammarError, match="unclosed group"):
        so.admit(Request("r3", (1,), SamplingParams(structured=GrammarSpec.of("regex", "(a"))), sched.add_request)
    failing: Future = Future()
    failing.set_exception(GrammarError("regex: the pool failed"))
    so.compiler.submit = lambda s: failing
    doomed = Request("r4", (1,), SamplingParams(structured=GrammarSpec.of("regex", "c+")))
    so.admit(doomed, sched.add_request)
    (delta,) = so.release_ready(sched.add_request)
    assert delta.request_id == "r4" and delta.finished and "the pool failed" in delta.abort_reason
    assert doomed not in sched.added and not so.has_parked()


def test_step_masks_follow_each_sample_and_an_errored_matcher_allows_only_eos(tiny_tok):
    tiny = tiny_tok
    from core.engine_core.types import RequestDelta, SampleDelta
    from core.request import Request
    from core.sampling_params import SamplingParams
    from core.scheduler import ScheduledSequence, SchedulerOutput
    from core.structured_output.bitmask import unpack_bitmask
    from core.structured_output.engine import needs_sync_step

    so, sched = _manager(tiny), _Scheduler()
    params = SamplingParams(structured=GrammarSpec.of("regex", "a+b"))
    req = Request("r", (1, 5), params)
    so.compiler.compile(params.structured)
    so.admit(req, sched.add_request)
    seq = req.seqs[0]
    plain = SamplingParams()
    entries = (ScheduledSequence(seq.seq_id, "r", (5,), 1, (), True, params, 0),
               ScheduledSequence(99, "other", (5,), 1, (), True, plain, 0))
    out = SchedulerOutput(entries, 0, 2)
    a, b = tiny.convert_tokens_to_ids("a"), tiny.convert_tokens_to_ids("b")
    step = so.step_bitmask(out, sched)
    assert step.seq_ids == (seq.seq_id,)  # only the constrained row
    assert needs_sync_step(out) and not needs_sync_step(SchedulerOutput(entries[1:], 0, 1))
    allowed = unpack_bitmask(step.bitmask, len(tiny))[0]
    assert allowed[a] and not allowed[b] and not allowed[tiny.eos_token_id]
    so.accept([RequestDelta("r", (SampleDelta(0, a, 0.0),))])
    allowed = unpack_bitmask(so.step_bitmask(out, sched).bitmask, len(tiny))[0]
    assert allowed[a] and allowed[b]
    so.accept([RequestDelta("r", (SampleDelta(0, tiny.eos_token_id, 0.0),))])  # forbidden here
    allowed = unpack_bitmask(so.step_bitmask(out, sched).bitmask, len(tiny))[0]
    assert allowed.nonzero().flatten().tolist() == [tiny.eos_token_id]
    so.accept([RequestDelta("r", (SampleDelta(0, tiny.eos_token_id, 0.0, finish_reason="stop"),), finished=True)])
    assert not so.active and so._matchers == {} and so._seq_index == {}


def test_numpy_path_masks_a_strided_view_in_place():
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(4, 80, generator=gen)
    view = wide[:, :70]  # the sampler's logits past the real vocabulary are sliced off
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    want = _reference_mask(view.contiguous(), mask, [3, 1])
    before = wide.clone()
    apply_bitmask_numpy(view, mask, rows=[3, 1])
    assert torch.equal(view, want)
    assert torch.equal(wide[:, 70:], before[:, 70:])
