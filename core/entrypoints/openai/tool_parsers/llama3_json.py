"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (``--tool-call-parser llama3_json``)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}
    {"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

The output is a tool call only when it starts (after whitespace and an optional
``<|python_tag|>``) with ``{``; anything else is plain content. Calls may be separated by
``;`` (Llama 3.2 writes that for parallel calls). An object without a string ``name`` is
content (so a plain JSON answer stays an answer), and so is text after the last call.
"""

from __future__ import annotations

from core.entrypoints.openai.tool_parsers.base import CallEmitter, DeltaMessage, ToolParser
from core.entrypoints.openai.tool_parsers.json_scan import CallObjectScan

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;,"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True

    def __init__(self, id_factory=None):
        super().__init__(id_factory)
        self._mode = "start"
        self._body = ""
        self._scan = CallObjectScan()
        self._call: CallEmitter | None = None

    def _consume(self, final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        while True:  # until a pass changes nothing
            before = (self._mode, len(self._pending), len(self._body))
            step = {"start": self._start, "call": self._in_call, "between": self._between}
            out += step.get(self._mode, self._after)(final)
            if (self._mode, len(self._pending), len(self._body)) == before:
                return out

    def _start(self, final: bool) -> list[DeltaMessage]:
        head = self._pending.lstrip()
        rest = head[len(PYTHON_TAG):].lstrip() if head.startswith(PYTHON_TAG) else head
        if not final and (not rest or PYTHON_TAG.startswith(head)):
            return []  # the first character that decides has not arrived yet
        if rest.startswith("{"):
            self._pending = rest
            self._begin_call()
        else:
            self._mode = "content"
        return []

    def _begin_call(self) -> None:
        self._mode, self._body, self._scan = "call", "", CallObjectScan()
        self._call = self._new_call()

    def _in_call(self, final: bool) -> list[DeltaMessage]:
        self._body += self._pending
        self._pending = ""
        scan = self._scan
        scan.advance(self._body)
        over = final or scan.done or scan.error is not None
        deltas = self._call.progress(scan, self._body, final=over and scan.error is None)
        out = [DeltaMessage(tool_calls=deltas)] if deltas else []
        if not over:
            return out
        call, self._call = self._call, None
        if call.started and scan.done:
            self._pending, self._mode = self._body[scan.end:], "between"
        else:  # not a call (no name), or broken JSON: the rest of the output is content
            self._drop_uncommitted(call)
            self._pending = ("" if call.started else self._body[: scan.pos]) + self._body[scan.pos:]
            self._mode = "content"
        self._body = ""
        return out

    def _between(self, final: bool) -> list[DeltaMessage]:
        rest = self._pending.lstrip(_SEPARATORS)
        if not rest:
            self._pending = ""
            return []
        if rest.startswith("{"):
            self._pending = rest
            self._begin_call()
        else:
            self._pending, self._mode = rest, "content"
        return []

    def _after(self, final: bool) -> list[DeltaMessage]:
        text, self._pending = self._pending, ""
        return self._text(text)
