"""A chat choice's generated text as OpenAI's message: reasoning split off
(``--reasoning-parser``), then tool calls parsed out (``tools``), whole or streamed.

:class:`ChoiceShape` is decided once per request (which parsers, which mode); each choice
gets its own parsers. The streamed pieces of a choice concatenate to the non-streamed
message: both run the same parser state machines (see ``reasoning.py`` and
``tool_parsers/``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.entrypoints.openai.protocol import AssistantMessage, DeltaMessage
from core.entrypoints.openai.reasoning import (
    ReasoningParser,
    extract_reasoning,
    make_reasoning_parser,
)
from core.entrypoints.openai.tool_parsers import ToolCall, forced_tool_parser, get_tool_parser
from core.entrypoints.openai.tool_parsers.base import DeltaMessage as ToolDelta
from core.entrypoints.openai.tool_parsers.base import DeltaToolCall


@dataclass(frozen=True)
class ChoiceShape:
    """How one request's choices are parsed.

    :param reasoning_parser: ``--reasoning-parser`` name, or None.
    :param prompt_tail: the end of the rendered prompt (a prompt that ends inside ``<think>``
        starts the output in the reasoning).
    :param tool_parser: ``--tool-call-parser`` name for ``tool_choice: auto``, or None.
    :param tool_choice: the request's ``tool_choice`` as a plain value when it forces a call
        (``"required"`` or ``{"type": "function", ...}``), else None.
    :param parallel_tool_calls: False keeps only the first call of a choice.
    """

    reasoning_parser: str | None = None
    prompt_tail: str = ""
    tool_parser: str | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    @property
    def parses_tools(self) -> bool:
        return self.tool_parser is not None or self.tool_choice is not None

    @property
    def forced_name(self) -> bool:
        """A named function was forced: OpenAI answers finish_reason 'stop' then."""
        return isinstance(self.tool_choice, dict)

    def _reasoning(self) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        return make_reasoning_parser(self.reasoning_parser, self.prompt_tail)

    def _tools(self) -> Any:
        if self.tool_choice is not None:
            return forced_tool_parser(self.tool_choice)
        return get_tool_parser(self.tool_parser)() if self.tool_parser is not None else None

    def message(self, text: str) -> AssistantMessage:
        """The whole message of one finished choice."""
        reasoning, content = None, text
        parser = self._reasoning()
        if parser is not None:
            reasoning, content = extract_reasoning(text, parser)
        calls: list[ToolCall] = []
        tools = self._tools()
        if tools is not None:
            content, calls = tools.extract(content or "")
            calls = calls if self.parallel_tool_calls else calls[:1]
        return AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if reason == "stop" and has_calls and not self.forced_name:
            return "tool_calls"
        return reason

    def streamer(self) -> ChoiceStreamer:
        return ChoiceStreamer(self, self._reasoning(), self._tools())


class ChoiceStreamer:
    """One streamed choice: text deltas in, OpenAI delta messages out."""

    def __init__(self, shape: ChoiceShape, reasoning: ReasoningParser | None, tools: Any):
        self._shape = shape
        self._reasoning = reasoning
        self._tools = tools
        self.has_calls = False

    def feed(self, text: str) -> DeltaMessage | None:
        """The delta for new text (None when nothing is certain yet)."""
        return self._step(text, final=False)

    def finish(self) -> DeltaMessage | None:
        """Flush what the parsers held back (the choice finished)."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> DeltaMessage | None:
        reasoning, content = None, text
        if self._reasoning is not None:
            pieces = [self._reasoning.feed(text)] + ([self._reasoning.finish()] if final else [])
            reasoning = "".join(p.reasoning_content or "" for p in pieces) or None
            content = "".join(p.content or "" for p in pieces)
        calls: list[DeltaToolCall] = []
        if self._tools is not None:
            tool_pieces: list[ToolDelta] = self._tools.feed(content) if content else []
            if final:
                tool_pieces += self._tools.finish()
            content = "".join(p.content or "" for p in tool_pieces)
            calls = [c for p in tool_pieces for c in p.tool_calls or ()]
            if not self._shape.parallel_tool_calls:
                calls = [c for c in calls if c.index == 0]
            self.has_calls = self.has_calls or bool(calls)
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning, tool_calls=calls or None)


def plain_tool_choice(tool_choice: Any) -> Any:
    """``tool_choice`` as the plain value the parsers and schemas take (a model to a dict)."""
    dump: Callable[..., Any] | None = getattr(tool_choice, "model_dump", None)
    return dump() if dump is not None else tool_choice
