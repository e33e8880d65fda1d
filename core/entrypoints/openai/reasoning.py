"""Split a reasoning model's output into ``reasoning_content`` and ``content``.

Reasoning models write their chain of thought between ``<think>`` and ``</think>`` and the
answer after it. Two conventions are in use:

* **Qwen3** (``--reasoning-parser qwen3``): the model writes both tags itself. Text before
  ``<think>`` is content; with no ``<think>`` at all (``enable_thinking: false``, whose
  template pre-fills an empty think block in the prompt) everything is content.
* **DeepSeek-R1** (``--reasoning-parser deepseek_r1``): the chat template ends the prompt
  with ``<think>``, so the output starts inside the reasoning and may contain only the
  closing tag. A leading ``<think>`` that the model writes anyway is dropped; with no
  ``</think>`` (the model ran out of tokens while thinking) everything is reasoning.

Any template that ends the prompt with the opening tag (Qwen3-Thinking-2507 does) needs the
second behaviour: :func:`make_reasoning_parser` takes the rendered prompt and picks it.

The same state machine serves the full text (:func:`extract_reasoning`) and the stream
(:meth:`ReasoningParser.feed`), so a stream split anywhere reassembles to the full-text
result. While streaming, a suffix that could still grow into a tag (``"<thi"``) is held back
until the next delta shows what it is, and released by :meth:`ReasoningParser.finish`.
After ``</think>`` the rest is content verbatim: a second ``<think>`` is not re-parsed.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"

_OUTSIDE, _MAYBE_START, _REASONING, _CONTENT = "outside", "maybe_start", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningDelta:
    """One piece of streamed output; a field is None when the piece adds nothing to it."""

    reasoning_content: str | None = None
    content: str | None = None

    def __bool__(self) -> bool:
        return bool(self.reasoning_content) or bool(self.content)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Streaming ``<think>`` splitter for one sequence (``n > 1``: one parser per choice).

    :param starts_in_reasoning: True when the prompt already opened the think block
        (DeepSeek-R1 convention); False when the model must write ``<think>`` itself.
    """

    def __init__(self, starts_in_reasoning: bool, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self._state = _MAYBE_START if starts_in_reasoning else _OUTSIDE
        self._pending = ""  # text not yet classified (a possible partial tag)

    def feed(self, delta: str) -> ReasoningDelta:
        """Classify ``delta`` (any split of the output text) and return what is now certain."""
        self._pending += delta
        reasoning, content = [], []
        while self._pending:
            if not self._step(reasoning, content):
                break
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)

    def finish(self) -> ReasoningDelta:
        """End of output: a held-back partial tag is plain text of the current part."""
        text, self._pending = self._pending, ""
        if not text:
            return ReasoningDelta()
        if self._state == _OUTSIDE or self._state == _CONTENT:
            return ReasoningDelta(content=text)
        return ReasoningDelta(reasoning_content=text)

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what can be decided from ``_pending``; False when more text is needed."""
        text = self._pending
        if self._state == _CONTENT:
            content.append(text)
            self._pending = ""
            return True
        if self._state == _MAYBE_START:  # R1: an optional opening tag at the very start
            if text.startswith(self.start):
                self._pending = text[len(self.start):]
            elif self.start.startswith(text):
                return False
            self._state = _REASONING
            return True
        tag, out = (self.start, content) if self._state == _OUTSIDE else (self.end, reasoning)
        at = text.find(tag)
        if at >= 0:
            out.append(text[:at])
            self._pending = text[at + len(tag):]
            self._state = _REASONING if self._state == _OUTSIDE else _CONTENT
            return True
        keep = _held_prefix(text, tag)
        out.append(text[: len(text) - keep])
        self._pending = text[len(text) - keep:]
        return False


def make_reasoning_parser(name: str, prompt: str = "") -> ReasoningParser:
    """The parser for ``--reasoning-parser NAME`` and one rendered prompt.

    :param name: ``"qwen3"`` or ``"deepseek_r1"`` (see the module docstring).
    :param prompt: the prompt text after the chat template; one that ends with ``<think>``
        (trailing whitespace allowed) starts the output inside the reasoning whatever the name.
    :raises ValueError: for an unknown name, listing the known ones.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)} "
            f"for --reasoning-parser"
        )
    in_prompt = prompt.rstrip().endswith(THINK_START)
    return ReasoningParser(starts_in_reasoning=REASONING_PARSERS[name] or in_prompt)


REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}
"""``--reasoning-parser`` names -> whether the output starts inside the think block."""


def extract_reasoning(text: str, parser: ReasoningParser) -> tuple[str | None, str | None]:
    """Split a whole output: ``(reasoning_content, content)``, None for an empty part.

    ``parser`` must be fresh (from :func:`make_reasoning_parser`); it is consumed.
    """
    first, last = parser.feed(text), parser.finish()
    reasoning = (first.reasoning_content or "") + (last.reasoning_content or "")
    content = (first.content or "") + (last.content or "")
    return reasoning or None, content or None
