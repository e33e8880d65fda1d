"""Structured output through the real engine (offline ``LLM`` and ``LLMEngine``, a tiny random
Llama on the CPU): the 23-schema suite (numbers bounded, see ``bounded_numbers``) at
temperature 0 and 1 validates with ``jsonschema``
(an implementation independent of the grammar library), n > 1 samples each follow the
grammar, regex / choice / grammar outputs match, bad specs are refused at once, requests
park while their grammar compiles without holding up others, and aborting or finishing a
request leaves no grammar state behind."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from core import LLM, SamplingParams
from core.structured_output import GrammarError, GrammarSpec
from tests.helpers import tiny_llama_dir
from tests.unit.structured_schemas import SCHEMAS, bounded_numbers

MAX_TOKENS = 200  # every schema of the suite ends far below this under its grammar


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = tiny_llama_dir(tmp_path_factory.mktemp("structured"), seed=5)
    return LLM(model=str(model), platform="cpu", dtype="float32", max_model_len=256)


def _json_params(schema: dict, temperature: float, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=temperature, seed=11, structured=GrammarSpec.of("json_schema", schema), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_of_the_suite_validates(llm, temperature):
    names = list(SCHEMAS)
    assert len(names) >= 20
    schemas = [bounded_numbers(SCHEMAS[n]) for n in names]
    params = [_json_params(s, temperature) for s in schemas]
    outs = llm.generate(["Answer in JSON:"] * len(names), params, use_tqdm=False)
    for name, schema, out in zip(names, schemas, outs):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (name, comp.text)
        jsonschema.validate(json.loads(comp.text), schema)


def test_output_cut_by_max_tokens_says_length(llm):
    # An unbounded integer: a greedy random model may write digits until max_tokens. Then
    # the finish reason must say so; a 'stop' would claim complete JSON.
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    comp = llm.generate(["x"], _json_params(schema, 0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    if comp.finish_reason == "stop":
        jsonschema.validate(json.loads(comp.text), schema)
    else:
        assert comp.finish_reason == "length" and len(comp.token_ids) == 8


def test_n_samples_each_follow_the_grammar(llm):
    schema = bounded_numbers(SCHEMAS["flat_required"])
    out = llm.generate(["x"], _json_params(schema, 1.0, n=4), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1  # independent samples, one matcher each
    for t in texts:
        jsonschema.validate(json.loads(t), schema)


def test_regex_choice_and_grammar(llm):
    specs = [
        (GrammarSpec.of("regex", r"(cat|dog)-[0-9]{3}"), r"(cat|dog)-[0-9]{3}"),
        (GrammarSpec.of("choice", ["alpha", "beta", "gamma"]), r"alpha|beta|gamma"),
        (GrammarSpec.of("grammar", 'start: "x" ("+" "x")*'), None),
        (GrammarSpec.of("json_object"), None),
    ]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured=spec)
              for s in range(4) for spec, _ in specs]
    outs = llm.generate(["go"] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        spec, pattern = specs[i % len(specs)]
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        if spec.kind == "json_object" and reason == "length":  # any object: may not end in 60 tokens
            assert text.startswith("{"), text
            continue
        assert reason == "stop", (spec, text)
        if pattern is not None:
            assert re.fullmatch(pattern, text), (spec, text)
        elif spec.kind == "grammar":
            assert re.fullmatch(r"x(\+x)*", text), text
        else:
            assert isinstance(json.loads(text), dict), text


def test_greedy_under_a_mask_is_reproducible_and_unconstrained_rows_are_untouched(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(["hello there"], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["hello there", "hello there"],
                         [plain, SamplingParams(temperature=0.0, max_tokens=12,
                                                structured=GrammarSpec.of("regex", "[0-9]+"))],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone  # the mask touched only its own row
    assert re.fullmatch(r"[0-9]+", mixed[1].outputs[0].text)


def test_a_refused_spec_fails_at_add_and_names_the_library_error(llm):
    with pytest.raises(GrammarError, match=r"(?s)regex.*unclosed group"):
        llm.generate(["x"], SamplingParams(structured=GrammarSpec.of("regex", "(ab")), use_tqdm=False)
    with pytest.raises(GrammarError, match="json_schema"):
        bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}
        llm.generate(["x"], SamplingParams(structured=GrammarSpec.of("json_schema", bad)), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.structured"):
        SamplingParams(structured={"type": "object"})


def test_parked_request_waits_for_its_compile_and_others_run(llm):
    eng = llm.engine
    structured = eng.core.structured
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}, "v": {"type": "integer"}},
              "required": ["k", "v"], "additionalProperties": False}  # new to this engine: not cached
    rid = eng.add_request(None, "a", _json_params(schema, 0.0))
    other = eng.add_request(None, "b", SamplingParams(temperature=0.0, max_tokens=3))
    assert eng.scheduler.get_request(other) is not None  # never waits for someone else's grammar
    outs = []
    deadline = time.monotonic() + 120
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        outs += eng.step()
    done = {o.request_id: o for o in outs if o.finished}
    assert set(done) == {rid, other}
    jsonschema.validate(json.loads(done[rid].outputs[0].text), schema)
    assert len(done[other].outputs[0].token_ids) == 3
    assert not structured.has_parked() and not structured.active  # nothing kept after finishing


def test_abort_drops_parked_and_running_grammar_state(llm):
    eng = llm.engine
    structured = eng.core.structured
    a = eng.add_request(None, "a", _json_params({"type": "array", "items": {"type": "integer"}, "maxItems": 50}, 1.0))
    b = eng.add_request(None, "b", _json_params({"type": "object", "properties": {"z": {"type": "boolean"}},
                                                 "required": ["z"]}, 1.0))
    eng.step()
    eng.abort_request(a)
    eng.abort_request(b)
    while eng.has_unfinished_requests():
        eng.step()
    assert not structured.has_parked() and not structured.active
    assert structured._matchers == {} and structured._seq_index == {}


def test_a_parked_request_holds_its_id_and_can_be_aborted(llm):
    from core.engine_core.types import EngineRequest

    eng = llm.engine
    structured = eng.core.structured
    gate, compile_now = threading.Event(), structured.compiler._compile
    structured.compiler._compile = lambda s: gate.wait(60) and compile_now(s)
    try:
        params = _json_params({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, 0.0)
        rid = eng.add_request(None, "p", params)
        assert structured.is_parked(rid) and eng.scheduler.get_request(rid) is None
        with pytest.raises(ValueError, match="already in use"):
            eng.core.add_request(EngineRequest(rid, (1, 2), params))
        eng.abort_request(rid)
        assert not structured.has_parked()
    finally:
        gate.set()
        structured.compiler._compile = compile_now
    while eng.has_unfinished_requests():
        eng.step()
