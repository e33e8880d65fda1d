"""What every tool-call parser shares: the OpenAI-shaped values, the streaming contract, and
the pieces that turn one scanned call object into ``tool_calls`` deltas.

A parser serves one sequence (``n > 1``: one parser per choice). ``feed(delta)`` takes any
split of the detokenized output (special tokens kept: ``[TOOL_CALLS]`` and
``<|python_tag|>`` are special tokens) and returns the :class:`DeltaMessage` pieces that are
now certain; ``finish()`` flushes the rest. ``extract(text)`` is the same machine run over
the whole text, so the full-text and streamed results agree by construction, and tests check
both against hand-written expectations at every split.

Delta order follows OpenAI: a call's first delta carries ``index``, ``id``, ``type`` and the
function name; later deltas carry argument fragments whose concatenation is the call's final
``arguments`` string (the model's own JSON text for the arguments object, unchanged).
Content is the text outside the tool-call markup with leading and trailing whitespace
removed (whitespace is held back while streaming until text follows it).
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from core.entrypoints.openai.tool_parsers.json_scan import CallObjectScan, _decode


class FunctionCall(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    arguments: str
    """JSON text of the arguments object, as the model wrote it (may be invalid JSON when the
    model wrote invalid JSON; OpenAI documents the same)."""


class ToolCall(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    model_config = ConfigDict(frozen=True)
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """One streamed piece: content text, or ``tool_calls`` deltas (never both)."""

    model_config = ConfigDict(frozen=True)
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


def random_call_id() -> str:
    """OpenAI-style ``call_`` + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def random_mistral_id() -> str:
    """Mistral's chat templates refuse tool-call ids that are not 9 letters or digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class ContentTrimmer:
    """Streams content with leading and trailing whitespace removed: whitespace is held until
    non-whitespace follows it, and dropped at the end (or at the very start)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not text:
            return ""
        body = text.rstrip()
        tail = text[len(body):]
        if not body:
            self._held += tail if self._started else ""
            return ""
        out = (self._held + body) if self._started else body.lstrip()
        self._started, self._held = True, tail
        return out


class CallEmitter:
    """Turns the progress of one scanned call object into deltas for call ``index``."""

    def __init__(self, index: int, call_id: str):
        self.index, self.id = index, call_id
        self.started = False  # name sent: the call is committed and cannot become content
        self.sent_args = 0
        self.name = ""
        self.arguments = ""

    def progress(self, scan: CallObjectScan, text: str, final: bool = False) -> list[DeltaToolCall]:
        """Deltas for what ``scan`` (over ``text``) shows beyond what was already sent.

        :param final: the object is over (closed, or the output ended): send an argument
            string value whole, and ``{}`` for a call that had no arguments.
        """
        out = []
        if not self.started:
            if scan.name is None:
                return out
            self.started, self.name = True, scan.name
            out.append(self._delta(id=self.id, type="function", name=scan.name, arguments=""))
        piece = self._argument_piece(scan, text, final or scan.done)
        if piece:
            self.arguments += piece
            out.append(self._delta(arguments=piece))
        return out

    def _argument_piece(self, scan: CallObjectScan, text: str, final: bool) -> str:
        if scan.args_start is None:
            return "{}" if final and not self.arguments else ""
        if scan.args_is_string:  # arguments given as a JSON string: send it decoded, once
            if scan.args_end is None or self.arguments:
                return ""
            return _decode(text[scan.args_start : scan.args_end])
        end = scan.args_end if scan.args_end is not None else scan.pos
        piece = text[scan.args_start + self.sent_args : end]
        self.sent_args += len(piece)
        return piece

    def _delta(self, *, id=None, type=None, name=None, arguments=None) -> DeltaToolCall:
        return DeltaToolCall(
            index=self.index, id=id, type=type, function=DeltaFunctionCall(name=name, arguments=arguments)
        )

    def tool_call(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))


class ToolParser(ABC):
    """Base of the per-format parsers (one object per sequence; see the module docstring).

    :param id_factory: makes each call's id (default: :func:`random_call_id`); tests pass a
        deterministic one.
    """

    name: str = ""
    """The ``--tool-call-parser`` name."""
    keeps_special_tokens: bool = False
    """The format's markers are special tokens (``[TOOL_CALLS]``, ``<|python_tag|>``): the
    text it parses must be detokenized with them."""

    def __init__(self, id_factory: Callable[[], str] | None = None):
        self._new_id = id_factory or random_call_id
        self._pending = ""
        self._content = ContentTrimmer()
        self._calls: list[CallEmitter] = []
        self._finished = False
        self._fed = False

    def feed(self, delta: str) -> list[DeltaMessage]:
        """The pieces that ``delta`` (appended to the output so far) makes certain."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.feed after finish(): use one parser per sequence")
        self._fed = True
        self._pending += delta
        return self._merge(self._consume(final=False))

    def finish(self) -> list[DeltaMessage]:
        """End of output: everything still held is sent."""
        if self._finished:
            return []
        self._finished = True
        return self._merge(self._consume(final=True))

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Parse a whole output on a fresh parser: ``(content or None, tool_calls)``."""
        if self._fed or self._finished:
            raise RuntimeError(f"{type(self).__name__}.extract needs a fresh parser")
        pieces = self.feed(text) + self.finish()
        content = "".join(p.content for p in pieces if p.content)
        return content or None, [c.tool_call() for c in self._calls if c.started]

    @abstractmethod
    def _consume(self, final: bool) -> list[DeltaMessage]:
        """Process ``self._pending`` as far as it can be decided (all of it when ``final``)."""

    def _text(self, text: str) -> list[DeltaMessage]:
        out = self._content.push(text)
        return [DeltaMessage(content=out)] if out else []

    def _new_call(self) -> CallEmitter:
        call = CallEmitter(len([c for c in self._calls if c.started]), self._new_id())
        self._calls.append(call)
        return call

    def _drop_uncommitted(self, call: CallEmitter) -> None:
        """A call object that never showed a name is not a call (its text becomes content)."""
        if not call.started:
            self._calls.remove(call)

    @staticmethod
    def _merge(pieces: list[DeltaMessage]) -> list[DeltaMessage]:
        """Join neighbouring content pieces, and neighbouring tool-call pieces."""
        out: list[DeltaMessage] = []
        for p in pieces:
            if out and p.content and out[-1].content:
                out[-1] = DeltaMessage(content=out[-1].content + p.content)
            elif out and p.tool_calls and out[-1].tool_calls:
                out[-1] = DeltaMessage(tool_calls=out[-1].tool_calls + p.tool_calls)
            else:
                out.append(p)
        return out


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (a tag
    that may still be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
