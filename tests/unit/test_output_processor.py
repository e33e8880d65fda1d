"""The front end's output half (core/output_processor.py) on a real byte-level BPE tokenizer:
token deltas in, text out; a reply cut mid-character never ends in U+FFFD; stop strings
finish a sample here and are reported for the engine core; token-level stops end the text
before the stop token."""

from __future__ import annotations

import pytest

from core.engine_core.types import EngineRequest, RequestDelta, SampleDelta
from core.output_processor import OutputProcessor
from core.sampling_params import SamplingParams
from tests.helpers import build_tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def _byte_id(tok, b: int) -> int:
    """The id of the single-byte token for byte ``b`` (GPT-2 byte-to-unicode alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        ch = chr(b)
    else:
        ch = chr(256 + [x for x in range(256) if x not in printable].index(b))
    tid = tok.convert_tokens_to_ids(ch)
    assert tid is not None and tid != tok.unk_token_id
    return tid


def _feed(proc: OutputProcessor, rid: str, ids: list[int], last_reason: str | None):
    """One delta per token; the last carries ``last_reason``. Returns every output."""
    outs, stops = [], []
    for k, t in enumerate(ids):
        reason = last_reason if k == len(ids) - 1 else None
        o, s = proc.process([RequestDelta(rid, (SampleDelta(0, t, -1.0, None, reason),), reason is not None)])
        outs += o
        stops += s
    return outs, stops


def _request(rid: str, **params) -> EngineRequest:
    return EngineRequest(rid, (1, 5, 6), SamplingParams(**params))


@pytest.mark.parametrize("final_only", [False, True])
def test_a_reply_cut_at_max_tokens_mid_character_never_ends_in_u_fffd(tok, final_only):
    a = tok.encode("a", add_special_tokens=False)
    e_acute = [_byte_id(tok, 0xC3), _byte_id(tok, 0xA9)]  # "é" as two byte tokens
    euro = [_byte_id(tok, 0xE2), _byte_id(tok, 0x82), _byte_id(tok, 0xAC)]  # "€": three
    assert tok.decode(a + e_acute) == "aé" and tok.decode(a + euro[:2]).endswith(REPLACEMENT)
    proc = OutputProcessor(tok)
    cases = {"cut1": a + e_acute + euro[:1], "cut2": a + e_acute + euro[:2], "whole": a + e_acute + euro}
    want = {"cut1": "aé", "cut2": "aé", "whole": "aé€"}
    for rid, ids in cases.items():
        proc.add_request(_request(rid, max_tokens=len(ids)), None, final_only=final_only)
        outs, _ = _feed(proc, rid, ids, "length")
        assert outs[-1].finished and outs[-1].outputs[0].text == want[rid]
        assert outs[-1].outputs[0].token_ids == tuple(ids)  # the tokens are all there
        assert not any(REPLACEMENT in o.outputs[0].text for o in outs)
        assert len(outs) == (1 if final_only else len(ids))


def test_a_stop_string_finishes_the_sample_here_and_is_reported(tok):
    ids = tok.encode("hello world and more", add_special_tokens=False)
    proc = OutputProcessor(tok)
    proc.add_request(_request("r", max_tokens=50, stop=("world",)), None)
    outs, stops = _feed(proc, "r", ids + ids, None)  # the engine would keep going
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and final[0].outputs[0].text == "hello "
    assert final[0].outputs[0].finish_reason == "stop" and final[0].outputs[0].stop_reason == "world"
    assert [(h.request_id, h.index) for h in stops] == [("r", 0)]
    assert outs[-1].finished  # later deltas for the finished request are dropped
    assert "r" not in proc


def test_a_stop_token_ends_the_text_before_it_unless_asked(tok):
    ids = tok.encode("one two", add_special_tokens=False)
    assert len(ids) >= 2
    for include, want in ((False, tok.decode(ids[:-1])), (True, "one two")):
        proc = OutputProcessor(tok)
        proc.add_request(_request("r", max_tokens=50, include_stop_str_in_output=include), None)
        outs, _ = _feed(proc, "r", ids, "stop")  # the last id is a stop token id
        assert outs[-1].outputs[0].text == want


def test_abort_and_engine_abort_reason_finish_every_sample(tok):
    proc = OutputProcessor(tok)
    proc.add_request(_request("a", n=2, max_tokens=5), "prompt text")
    proc.add_request(_request("b", n=3, max_tokens=5), None)
    out = proc.abort("a")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert out.prompt == "prompt text" and proc.abort("a") is None
    outs, _ = proc.process([RequestDelta("b", finished=True, abort_reason="can no longer fit")])
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert not proc.has_unfinished()


def test_the_input_processor_refuses_what_is_not_a_prompt(tok):
    from core.input_processor import InputProcessor

    inp = InputProcessor(tok, 512, max_model_len=64)
    for bad, match in [(None, "empty"), ([], "empty"), (123, "not int"), ({"a": 1}, "not dict"),
                       ([1, True], "must be integers"), ([1, 2.0], "must be integers"),
                       ([1, 512], r"outside the vocabulary \[0, 512\)"), (list(range(1, 65)), "max_model_len is 64")]:
        with pytest.raises(ValueError, match=match):
            inp.process("r", bad, SamplingParams())
    req, text = inp.process("r", "hi there", SamplingParams(max_tokens=None))
    assert text == "hi there" and req.params.max_tokens == 64 - len(req.prompt_token_ids)
