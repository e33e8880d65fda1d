"""The ``<think>`` splitter: whole texts against hand-written splits, and every stream split
(two pieces at each character boundary, and one character at a time) reassembling to them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.entrypoints.openai.reasoning import (
    ReasoningParser,
    extract_reasoning,
    make_reasoning_parser,
)

# (parser name, prompt, model output, expected reasoning_content, expected content)
CASES = [
    ("qwen3", "", "<think>\nThe user wants 2+2.\n</think>\n\n4", "\nThe user wants 2+2.\n", "\n\n4"),
    ("qwen3", "", "Paris is the capital.", None, "Paris is the capital."),
    ("qwen3", "", "<think></think>Hi", None, "Hi"),
    ("qwen3", "", "Sure. <think>hmm</think> done", "hmm", "Sure.  done"),
    ("qwen3", "", "<think>still thinking when max_tokens hit", "still thinking when max_tokens hit", None),
    ("qwen3", "", "a < b and x <th y", None, "a < b and x <th y"),
    ("qwen3", "", "<think>1 </thin 2</think>x<think>y</think>", "1 </thin 2", "x<think>y</think>"),
    ("qwen3", "", "ends with a partial <thi", None, "ends with a partial <thi"),
    # the template pre-opened the block (Qwen3-Thinking-2507): starts inside reasoning
    ("qwen3", "<|im_start|>assistant\n<think>\n", "plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "", "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "", "<think>Let me think.</think>4", "Let me think.", "4"),
    ("deepseek_r1", "", "no closing tag at all", "no closing tag at all", None),
    ("deepseek_r1", "", "<thi", "<thi", None),
    ("deepseek_r1", "", "<think", "<think", None),
    ("deepseek_r1", "", "</think>only answer", None, "only answer"),
    ("deepseek_r1", "", "x</think", "x</think", None),
]


def _stream(name: str, prompt: str, pieces: list[str]) -> tuple[str | None, str | None]:
    parser = make_reasoning_parser(name, prompt)
    reasoning, content = [], []
    for d in [*(parser.feed(p) for p in pieces), parser.finish()]:
        assert d.reasoning_content != "" and d.content != "", "empty strings must be None"
        reasoning.append(d.reasoning_content or "")
        content.append(d.content or "")
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_full_text(name, prompt, text, reasoning, content):
    assert extract_reasoning(text, make_reasoning_parser(name, prompt)) == (reasoning, content)


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_stream_split_anywhere(name, prompt, text, reasoning, content):
    for i in range(len(text) + 1):
        assert _stream(name, prompt, [text[:i], text[i:]]) == (reasoning, content), i
    assert _stream(name, prompt, list(text)) == (reasoning, content)


def test_reasoning_streams_before_the_closing_tag():
    """Reasoning is released as it arrives, not held until ``</think>``."""
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("<think>step one").reasoning_content == "step one"
    held = parser.feed(" and </th")  # the partial closing tag is held back
    assert held.reasoning_content == " and " and held.content is None
    assert parser.feed("ink>Done").content == "Done"


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"'qwen2'.*deepseek_r1.*qwen3"):
        make_reasoning_parser("qwen2")


def test_custom_tags():
    parser = ReasoningParser(starts_in_reasoning=False, start="<reasoning>", end="</reasoning>")
    assert extract_reasoning("<reasoning>r</reasoning>c", parser) == ("r", "c")


_piece = st.text(st.sampled_from("ab <>/thinkTHINK\n"), max_size=10).filter(lambda s: "<think>" not in s and "</think>" not in s)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["qwen3", "deepseek_r1"]),
    before=_piece, reasoning=_piece, after=_piece, opened=st.booleans(), closed=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=5),
)
def test_any_text_any_split(name, before, reasoning, after, opened, closed, cuts):
    """Build an output from parts, so the expected split is known without the parser."""
    if name == "deepseek_r1":
        text = ("<think>" if opened else "") + reasoning + ("</think>" + after if closed else "")
        want = (reasoning or None, (after or None) if closed else None)
    else:
        text = before + ("<think>" + reasoning + ("</think>" + after if closed else "") if opened else "")
        want = ((reasoning or None) if opened else None, (before + (after if opened and closed else "")) or None)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert _stream(name, "", pieces) == want
    assert extract_reasoning(text, make_reasoning_parser(name)) == want
