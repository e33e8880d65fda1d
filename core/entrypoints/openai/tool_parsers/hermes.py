"""Hermes / Qwen2.5 / Qwen3 tool calls (``--tool-call-parser hermes``)::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Each ``<tool_call>`` block holds one JSON object. A block whose object never shows a string
``name`` is not a call: its text, tags included, stays in the content. A missing closing tag
at the end of the output (the model stopped right after the object) still ends the call.
"""

from __future__ import annotations

from core.entrypoints.openai.tool_parsers.base import (
    CallEmitter,
    DeltaMessage,
    ToolParser,
    held_prefix,
)
from core.entrypoints.openai.tool_parsers.json_scan import CallObjectScan

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, id_factory=None):
        super().__init__(id_factory)
        self._call: CallEmitter | None = None
        self._scan = CallObjectScan()
        self._body = ""

    def _consume(self, final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        while True:  # until a pass changes nothing: each pass handles one block or gap
            before = (len(self._pending), self._call)
            out += self._block(final) if self._call else self._outside(final)
            if not self._pending or (len(self._pending), self._call) == before:
                return out

    def _outside(self, final: bool) -> list[DeltaMessage]:
        text = self._pending
        at = text.find(OPEN)
        if at >= 0:
            self._pending = text[at + len(OPEN):]
            self._call, self._scan, self._body = self._new_call(), CallObjectScan(), ""
            return self._text(text[:at])
        keep = 0 if final else held_prefix(text, OPEN)
        self._pending = text[len(text) - keep:] if keep else ""
        return self._text(text[: len(text) - keep])

    def _block(self, final: bool) -> list[DeltaMessage]:
        text = self._pending
        at = text.find(CLOSE)
        closed = at >= 0
        keep = 0 if final or closed else held_prefix(text, CLOSE)
        body_part = text[:at] if closed else text[: len(text) - keep]
        self._pending = text[at + len(CLOSE):] if closed else text[len(text) - keep:]
        self._body += body_part
        self._scan.advance(self._body)
        call = self._call
        deltas = call.progress(self._scan, self._body, final=closed or final)
        out = [DeltaMessage(tool_calls=deltas)] if deltas else []
        if closed or final:
            self._call = None
            if not call.started:  # not a call after all: the block is content
                self._drop_uncommitted(call)
                out += self._text(OPEN + self._body + (CLOSE if closed else ""))
        return out
